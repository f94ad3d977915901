"""docs/config.md, the configuration reference `python -m dapo_trl.config.reference` writes: current, and every field
DAPOConfig adds and every script field of the command line documented in exactly one group."""

import collections
import dataclasses
import inspect

import pytest
from trl import GRPOConfig, ScriptArguments

from dapo_trl.cli.arguments import DAPOScriptArguments
from dapo_trl.config import DAPOConfig
from dapo_trl.config import reference as config_reference
from dapo_trl.config.groups import GROUPS, Group
from dapo_trl.config.reference import check, main, placement_problems, render

from .helpers import REPO


def test_docs_config_md_is_current():
    diff = check()
    assert not diff, f"docs/config.md is not current: run `{config_reference.REGENERATE}` and commit it.\n" + "\n".join(
        diff[:60]
    )


def test_every_own_field_and_script_field_is_in_exactly_one_group():
    trl_fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    own = {field.name for field in dataclasses.fields(DAPOConfig)} - trl_fields
    script = set(inspect.get_annotations(DAPOScriptArguments))
    assert own and script and not own & script
    placed = collections.Counter(name for group in GROUPS for name in group.fields)
    assert set(placed) == own | script, (
        f"in no group: {sorted(own | script - set(placed))}; not a field: {sorted(set(placed) - own - script)}"
    )
    assert [name for name, count in placed.items() if count > 1] == []
    assert placement_problems() == []


def test_every_field_appears_on_the_page_with_its_default_and_help():
    page = render()
    for name, field in {**config_reference.dapo_config_fields(), **config_reference.script_fields()}.items():
        entry = page.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        assert config_reference.code(config_reference.default_of(field)) in entry, name
        assert config_reference.help_of(field) in entry, name
    assert "| `epsilon_high` | GRPOConfig | `None` | `0.28` |" in page  # a TRL default DAPO changes, both values
    assert "`dataset_train_split`" in page and "`model_name_or_path`" in page  # TRL's fields named, linked


def test_a_forgotten_duplicated_or_stale_field_is_named(monkeypatch):
    first, *rest = GROUPS
    forgotten = Group(first.title, first.intro, first.fields[1:])
    assert placement_problems([forgotten, *rest]) == [
        f"{first.fields[0]} is in no group of dapo_trl/config/groups.py GROUPS: add it to the group of its concern"
    ]
    twice = Group("Again", "", (first.fields[0],))
    assert placement_problems([*GROUPS, twice]) == [
        f"{first.fields[0]} is in more than one group: {first.title}, Again"
    ]
    stale = Group("Gone", "", ("no_such_field",))
    assert "'no_such_field'" in placement_problems([*GROUPS, stale])[0]
    monkeypatch.setattr(config_reference, "GROUPS", (forgotten, *rest))
    with pytest.raises(ValueError, match=first.fields[0]):
        render()
    assert main(["--check"]) == 1


def test_check_fails_on_a_stale_page_and_passes_once_regenerated(tmp_path, capsys):
    page = tmp_path / "config.md"
    stale = render().replace("· default `10`", "· default `12`")  # max_filter_gen_batches, as if its default moved
    assert stale != render()
    page.write_text(stale)
    assert main(["--check", "--output", str(page)]) == 1
    message = capsys.readouterr().err
    assert "not current" in message and config_reference.REGENERATE in message
    assert main(["--output", str(page)]) == 0
    assert main(["--check", "--output", str(page)]) == 0
    assert page.read_text() == render()


def test_the_script_arguments_said_to_be_read_are_the_ones_the_package_reads():
    source = "\n".join(path.read_text() for path in (REPO / "dapo_trl").rglob("*.py"))
    inherited = config_reference.inherited_names(ScriptArguments, config_reference.script_fields())
    read = [name for name in inherited if f".{name}" in source]
    assert read == list(config_reference.SCRIPT_ARGUMENTS_READ)
