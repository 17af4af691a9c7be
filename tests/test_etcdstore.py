"""The job's store on an etcd cluster (core/etcdstore.py): the default store's semantics,
nothing for a client without the job's certificate, and exact counts and answered waits
while the member a client talks to, or the cluster's leader, is killed."""
import os
import re
import shutil
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from trainmover.core.etcdstore import EtcdClient, EtcdTLS
from trainmover.core.kvserver import KVServer
from trainmover.core.kvstore import (KVClient, StoreError, StoreNotANumber, StoreRefused,
                                     StoreTimeout, store_key)

from trainmover.bench.etcd_cluster import EtcdCluster, make_certs

import test_kvstore

if shutil.which("etcd") is None or shutil.which("openssl") is None:
    if os.environ.get("TRAINMOVER_REQUIRE_ETCD"):
        raise RuntimeError("TRAINMOVER_REQUIRE_ETCD is set but etcd or openssl is missing "
                           "(Debian: etcd-server, openssl)")
    pytest.skip("needs etcd (Debian: etcd-server) and openssl", allow_module_level=True)

KEY = store_key(b"k" * 32)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield c
    c.stop()


def client(cluster, key=KEY, **kw):
    return EtcdClient(cluster.endpoints, key, kw.pop("timeout_s", 5.0), cluster.tls, **kw)


@pytest.mark.timeout(120)
def test_values_counters_and_waits_answer_as_the_default_store(cluster):
    c, other = client(cluster), client(cluster)
    c.set("a", "1")
    assert c.get("a") == b"1" and c.try_get("none") is None
    assert c.add("n", 5) == 5 and c.add("n", -2) == 3
    assert c.compare_set("c", "", "x") == b"x"      # missing and expected empty: set
    assert c.compare_set("c", "y", "z") == b"x"     # not the expected value: unchanged
    assert c.compare_set("c", "x", "z") == b"z"
    assert c.compare_set("q", "e", "d") == b"e"     # missing, expected not empty: unset
    c.append("ap", "1,")
    c.append("ap", "2,")
    assert other.get("ap") == b"1,2,"
    c.set("s", "x")
    with pytest.raises(StoreNotANumber):
        c.add("s", 1)
    assert sorted(c.list_keys()) == ["a", "ap", "c", "n", "s"] and c.num_keys() == 5
    assert c.check(["a", "n"]) and not c.check(["a", "none"])
    assert c.delete_key("a") and not c.delete_key("a")
    # more keys than one etcd transaction takes (128 operations)
    names = [f"m{i}" for i in range(300)]
    c.multi_set(names, [str(i).encode() for i in range(300)])
    assert other.multi_get(names) == [str(i).encode() for i in range(300)]
    assert other.try_multi_get(["m1", "none", "m299"]) == [b"1", None, b"299"]
    # deleted in transactions of 128 as well: those there counted, the others kept
    assert c.delete_keys(names[:250] + ["none"]) == 250
    assert other.try_multi_get(["m0", "m249", "m250"]) == [None, None, b"250"]
    assert c.delete_keys(names[250:]) == 50 and c.delete_keys([]) == 0

    def later():
        time.sleep(0.5)
        other.set("late", "v")
        other.set("late2", "w")
    threading.Thread(target=later).start()
    t0 = time.monotonic()
    assert c.multi_get(["late", "late2"]) == [b"v", b"w"]
    assert 0.4 < time.monotonic() - t0 < 4
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="never"):
        c.wait(["never"], 0.5)
    assert 0.45 < time.monotonic() - t0 < 3


# the default store's tests' operations, ``get`` as ``try_get`` (a missing key would wait)
_ops = st.lists(test_kvstore._ops, max_size=20).map(
    lambda ops: [("try_get",) + tuple(op[1:]) if op[0] == "get" else op for op in ops])


def _apply(store, op):
    name, *args = op
    try:
        return getattr(store, name)(*args)
    except StoreError as exc:
        return type(exc).__name__


@pytest.mark.timeout(240)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_any_sequence_of_operations_answers_as_on_the_default_store(cluster, ops):
    """Each example a run of its own (its own key prefix on the shared cluster)."""
    run = store_key(os.urandom(16))
    srv = KVServer.listen(run)
    try:
        mine = client(cluster, key=run)
        theirs = KVClient("127.0.0.1", srv.port, run, 5.0)
        for op in ops:
            assert _apply(mine, op) == _apply(theirs, op), op
        assert sorted(mine.list_keys()) == sorted(theirs.list_keys())
    finally:
        srv.close()


@pytest.mark.timeout(120)
def test_runs_on_one_cluster_see_none_of_each_others_keys(cluster):
    a, b = client(cluster, key=store_key(b"run a")), client(cluster, key=store_key(b"run b"))
    a.set("decision", "commit")
    assert b.try_get("decision") is None and b.list_keys() == [] and b.num_keys() == 0
    with pytest.raises(StoreTimeout):
        b.get("decision", 0.3)


@pytest.mark.timeout(120)
def test_a_client_without_the_jobs_certificate_gets_nothing(cluster, tmp_path):
    client(cluster).set("secret", "x")
    # a certificate of another authority: the members refuse it
    foreign, _, _ = make_certs(tmp_path / "foreign", ["127.0.0.1"])
    with pytest.raises(StoreRefused):
        EtcdClient(cluster.endpoints, KEY, 2.0,
                   EtcdTLS(cluster.tls.ca, foreign.cert, foreign.key), failover_s=2.0)
    # no certificate at all
    with pytest.raises(StoreRefused):
        EtcdClient(cluster.endpoints, KEY, 2.0,
                   EtcdTLS(cluster.tls.ca, None, None), failover_s=2.0)
    # members the job's authority did not certify: the client refuses them
    with pytest.raises(StoreRefused):
        EtcdClient(cluster.endpoints, KEY, 2.0,
                   EtcdTLS(foreign.ca, cluster.tls.cert, cluster.tls.key), failover_s=2.0)


@pytest.mark.timeout(180)
def test_counts_stay_exact_and_waits_are_answered_while_members_are_killed(tmp_path):
    """Two writers add and append in a loop while first the leader, then (once it is back)
    the member both clients talk to is killed: every add's answer is distinct and the
    counter ends at their number, each append is in the value once, and a wait that was
    in progress on the killed member is answered by the next."""
    c = EtcdCluster(tmp_path, members=3).start()
    try:
        stop = threading.Event()
        answers: list[list[int]] = [[], []]
        clients: list = [None, None]
        errors: list[BaseException] = []

        def writer(i: int) -> None:
            store = clients[i] = client(c, failover_s=20.0)
            try:
                while not stop.is_set():
                    answers[i].append(store.add("votes", 1))
                    store.append("log", f"{i}.{len(answers[i])},")
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        waiter_result: list = []
        waiter = client(c, failover_s=20.0)
        waiting = threading.Thread(
            target=lambda: waiter_result.append(waiter.get("late", 60.0)))
        waiting.start()
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        leader = c.leader()
        c.kill(leader)
        time.sleep(2.0)
        c.start_member(leader)
        time.sleep(2.0)
        c.kill(clients[0]._at)    # the member a writer is talking to now
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert all(store.failovers > 0 for store in clients)
        reader = client(c, failover_s=20.0)
        reader.set("late", "here")
        waiting.join(60)
        assert waiter_result == [b"here"]
        every = sorted(answers[0] + answers[1])
        assert every == list(range(1, len(every) + 1)), "an add counted twice or lost"
        assert int(reader.get("votes")) == len(every) > 20
        log = reader.get("log").decode().split(",")[:-1]
        expected = {f"{i}.{n}" for i in range(2) for n in range(1, len(answers[i]) + 1)}
        assert sorted(log) == sorted(expected), "an append lost or made twice"
    finally:
        c.stop()


@pytest.mark.timeout(120)
def test_an_add_or_append_whose_answer_is_lost_counts_once(cluster, monkeypatch):
    """The member commits the write, then its answer is lost: the client retries on
    another member and finds the first try's result instead of counting again."""
    from trainmover.core import etcdstore

    real = etcdstore._Member.post
    lost = []

    def post(self, path, body, timeout):
        out = real(self, path, body, timeout)
        if path == "/v3/kv/txn" and not lost and out.get("succeeded") \
                and any("request_put" in op for op in body.get("success", [])):
            lost.append(path)
            raise etcdstore._Unavailable("answer lost")
        return out

    store = client(cluster, key=store_key(os.urandom(8)))
    monkeypatch.setattr(etcdstore._Member, "post", post)
    assert store.add("n", 3) == 3 and lost and store.failovers == 1
    assert store.add("n", 1) == 4
    lost.clear()
    store.append("log", "a,")
    assert lost and store.try_get("log") == b"a,"
    lost.clear()
    assert store.add("n", 1) == 5 and store.try_get("n") == b"5"


@pytest.mark.timeout(400)
def test_a_job_on_etcd_migrates_and_recovers_to_the_built_in_stores_weights(
        cluster, tmp_path, reference_weights):
    """The whole job (controller, agent, workers, the backends' rendezvous) on the etcd
    store: a planned migration and a crash recovered from a replica, ending on the
    uninterrupted run's weights (made on the built-in store)."""
    from trainmover.cli import apply_worker_faults
    from trainmover.control.coordinator import run_job
    from trainmover.core.faults import Inject
    from trainmover.core.topology import Layout
    from trainmover.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = 30          # the crash well after the migration is done
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=2, health_heartbeat_timeout_s=2.0,
                 recovery_report_timeout_s=4.0)
    baseline = reference_weights(cfg.validate())
    on_etcd = type(cfg).from_dict(cfg.to_dict())
    on_etcd.process.etcd = cluster.address()
    apply_worker_faults(on_etcd, [Inject("crash", 26, "w1", "allreduce")])
    summary = run_job(on_etcd.validate(), str(tmp_path / "run"), quiet=True, timeout_s=300,
                      injects=[Inject("migrate", 4, "w0")])
    assert [m["status"] for m in summary["migrations"]] == ["done"]
    (rec,) = summary["recoveries"]
    assert rec["status"] == "done" and list(rec["failures"].values()) == ["crash"]
    assert summary["weights_sha256"] == baseline and summary["steps"] == 30
    control = (tmp_path / "run" / "control.json").read_text()
    assert "etcd://" in control


def test_a_bad_etcd_address_is_refused_naming_it(tmp_path):
    from trainmover.recipes import get_recipe

    cfg = get_recipe("tiny")
    for bad, words in (("etcd://host?ca=a&cert=b&key=c", "'host' in"),
                       ("etcd://h:1?ca=/nonexistent&cert=b&key=c", "ca='/nonexistent'"),
                       ("etcd://h:1?cert=b&key=c", "needs ca=FILE"),
                       ("etcd://h:1?ca=a&cert=b&key=c&user=x", "unknown setting(s) user")):
        cfg.process.etcd = bad
        with pytest.raises(ValueError, match=re.escape(words)):
            cfg.validate()
    key = tmp_path / "client.key"
    key.write_text("k")
    key.chmod(0o644)
    cfg.process.etcd = f"etcd://h:1?ca={key}&cert={key}&key={key}"
    with pytest.raises(ValueError, match="readable by other users"):
        cfg.validate()
