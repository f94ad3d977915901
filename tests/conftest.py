"""Session-wide set-up: Ctrl-C behaves as in a terminal, however pytest was started."""

import signal


def pytest_configure(config) -> None:
    """A shell starts a background job (`pytest &`, nohup) with SIGINT ignored, which Python and every process it
    launches inherit, so the Ctrl-C tests (tests/test_preemption.py, tests/test_vllm.py) would test the launch, not
    the code. Restore Python's own handler: the processes the tests start then get the default disposition."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
