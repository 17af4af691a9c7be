"""The controller's garbage-collector measures (control/collector.py)."""
import gc
import threading

import pytest

from trainmover.control import collector


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    gc.enable() if was else gc.disable()
    gc.unfreeze()


def test_paused_turns_collections_off_until_the_last_block_in_any_thread_ends(gc_state):
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with collector.paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():              # nested
            assert not gc.isenabled()
        assert not gc.isenabled()
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()                 # the other thread's block still runs
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_paused_leaves_collections_off_if_they_were_off_and_survives_an_error(gc_state):
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(RuntimeError):
        with collector.paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_settle_freezes_what_exists_and_release_gives_it_back(gc_state):
    gc.unfreeze()
    kept = [[i] for i in range(1000)]         # tracked objects that exist at the settle
    collector.settle()
    assert gc.get_freeze_count() >= len(kept)
    old = {id(o) for o in gc.get_objects(generation=2)}
    assert not any(id(x) in old for x in kept)    # out of the generations a collection walks
    collector.release()
    assert gc.get_freeze_count() == 0
