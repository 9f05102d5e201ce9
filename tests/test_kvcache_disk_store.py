"""The local-disk store: the second BlockStore backend."""

from deepserve.kvcache.disk_store import DiskStore


def test_round_trip_and_missing_keys(tmp_path):
    store = DiskStore(tmp_path, max_bytes=10_000)
    assert store.put_many([("a", b"alpha"), ("b", b"beta")]) == 2
    assert store.get_many(["a", "zz", "b"]) == [b"alpha", None, b"beta"]
    assert store.exists_many(["a", "zz"]) == [True, False]


def test_each_key_is_written_once(tmp_path):
    store = DiskStore(tmp_path, max_bytes=10_000)
    store.put_many([("a", b"first")])
    assert store.put_many([("a", b"second")]) == 0
    assert store.get_many(["a"]) == [b"first"]


def test_size_cap_evicts_least_recently_used_files(tmp_path):
    store = DiskStore(tmp_path, max_bytes=250)
    store.put_many([("a", b"." * 100), ("b", b"." * 100)])
    store.get_many(["a"])
    store.put_many([("c", b"." * 100)])
    assert store.exists_many(["a", "b", "c"]) == [True, False, True]
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert on_disk == store.used_bytes <= 250


def test_writes_leave_no_temporary_files(tmp_path):
    store = DiskStore(tmp_path, max_bytes=10_000)
    store.put_many([(f"k{i}", b"v" * i) for i in range(1, 20)])
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".kvb"]


def test_a_new_instance_sees_the_previous_files_and_drops_stray_temps(tmp_path):
    DiskStore(tmp_path, max_bytes=10_000).put_many([("a", b"alpha")])
    (tmp_path / "half-written.tmp").write_bytes(b"xx")
    store = DiskStore(tmp_path, max_bytes=10_000)
    assert store.get_many(["a"]) == [b"alpha"]
    assert not (tmp_path / "half-written.tmp").exists()


def test_delete_removes_the_file(tmp_path):
    store = DiskStore(tmp_path, max_bytes=10_000)
    store.put_many([("a", b"alpha")])
    store.delete(["a"])
    assert store.get_many(["a"]) == [None] and store.used_bytes == 0
    assert not list(tmp_path.iterdir())
