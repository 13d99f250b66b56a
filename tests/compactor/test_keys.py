from compactor.keys import Keys


def test_key_layout_literal_strings_are_pinned() -> None:
    k = Keys()
    assert k.stream(3) == "compaction:events:3"
    assert k.dead == "compaction:dead"
    assert k.failures("s1") == "compaction:failures:s1"
    assert k.session("s1") == "compaction:session:s1"
    assert k.sessions == "compaction:sessions"
    assert k.uuids("s1") == "compaction:uuids:s1"
    assert k.lease(0) == "compaction:lease:0"
    assert k.fence(0) == "compaction:fence:0"
    assert k.job("s1") == "compaction:job:s1"
    assert k.retrigger("s1") == "compaction:retrigger:s1"
    assert k.watchers == "compaction:watchers"
    assert k.janitor == "compaction:janitor"
    assert k.claims == "compaction:claims"
    assert k.held == "compaction:held"
    assert k.sent("s1") == "compaction:sent:s1"
    assert k.consumer(5) == "shard-5"
    assert k.group == "compaction-watchers"
    assert k.queue == "compaction"


def test_shard_is_crc32_of_utf8_session_id_modulo_shards() -> None:
    import zlib

    k = Keys(prefix="p", shards=8)
    for sid in ["a", "session-1", "ÄÖ", "x" * 128]:
        assert k.shard_of(sid) == zlib.crc32(sid.encode("utf-8")) % 8
    assert Keys(shards=1).stream_for("anything") == "compaction:events:0"
    assert Keys(prefix="p").stream_for("a") == f"p:events:{zlib.crc32(b'a') % 8}"


def test_a_custom_prefix_is_used_by_every_key() -> None:
    k = Keys(prefix="acme")
    built = [k.stream(0), k.dead, k.failures("s"), k.session("s"), k.uuids("s"), k.sessions, k.lease(0),
             k.fence(0), k.watchers, k.claims, k.janitor, k.job("s"), k.retrigger("s"), k.group, k.queue,
             k.replaced("j")]
    assert all(key.startswith("acme") and "compaction" not in key for key in built)
    assert all("::" not in key for key in built)


def test_the_docs_xadd_examples_name_their_sessions_shard() -> None:
    """Agents in other languages copy these lines: a wrong shard splits a session over two streams."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    example = re.compile(r"XADD compaction:events:(\d+) \* session (\S+) ")
    found = [(path.name, int(n), sid) for path in (root / "README.md", root / "docs" / "STREAM_PROTOCOL.md")
             for n, sid in example.findall(path.read_text())]
    assert {name for name, _, _ in found} == {"README.md", "STREAM_PROTOCOL.md"}
    for name, shard, sid in found:
        assert shard == Keys().shard_of(sid), f"{name}: {sid} goes to shard {Keys().shard_of(sid)}, not {shard}"
