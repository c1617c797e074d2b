"""SIGTERM and SIGHUP end a verb like Ctrl-C, as an exception, after its saves: a save under
`held()` is never cut in the middle (issue 28, item 1)."""

from __future__ import annotations

import os
import signal

import pytest

from kvtool.commands.common import signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_an_ending_signal_raises_terminated_in_the_main_thread(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    with signals.installed():
        with pytest.raises(signals.Terminated) as e:
            os.kill(os.getpid(), sig)
            for _ in range(10**6):  # the handler runs at the next bytecode boundary
                pass
        assert e.value.exit_code == 128 + sig and isinstance(e.value, KeyboardInterrupt)
        with pytest.raises(signals.Terminated):
            signals.check()  # caught somewhere (a reply stopped): the verb still ends
    assert signal.getsignal(sig) is before


def test_a_signal_during_a_save_comes_after_it() -> None:
    done = []
    with signals.installed(), pytest.raises(signals.Terminated), signals.held():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):
            pass
        done.append("saved")  # reached: the signals wait for the block
    assert done == ["saved"]


def test_ctrl_c_is_still_a_keyboard_interrupt() -> None:
    with signals.installed():
        with pytest.raises(KeyboardInterrupt) as e:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**6):
                pass
        assert not isinstance(e.value, signals.Terminated) and signals.ending() is None
