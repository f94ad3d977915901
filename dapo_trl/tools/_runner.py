"""Runs the model's code inside the sandbox: `python -I -B -c <this source>`, code on stdin.

Like a notebook cell (and ReTool's interpreter), the value of a final bare expression is printed. Tracebacks show
only the model's own frames, with its source lines, so the model reads the error it made and nothing of ours.
"""

import ast
import builtins
import linecache
import os
import sys
import traceback

FILENAME = "<code>"


def _print_error(error):
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)


def main():
    source = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the program's stdin stays open for its whole life
    linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        tree = ast.parse(source, FILENAME, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, FILENAME, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, FILENAME, "eval"), namespace)
            if value is not None:
                print(value)
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - every error is the program's, reported like Python would
        _print_error(error)
        sys.stdout.flush()
        sys.exit(1)


main()
