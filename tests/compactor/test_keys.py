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


def test_operations_lists_every_key_and_every_state_field() -> None:
    """SPEC §6 leaves the keys beyond its own to the project "to choose and document": an operator
    reading Redis (or granting an ACL) had only this module's docstring, and two keys were missing
    from it. Every key a ``Keys`` builder makes, and every field of the stored state, is named in
    OPERATIONS.md's "Redis keys" (a key added without its line fails here)."""
    import inspect
    import re
    from dataclasses import fields
    from pathlib import Path

    from events.state import SessionState

    text = (Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md").read_text()
    section = text.split("### Redis keys", 1)[1].split("\n## ", 1)[0]
    k = Keys(prefix="{p}")
    placeholder = {"session_id": "{sessionId}", "shard": "{n}", "job_id": "{jobId}"}
    built = {}
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_") or name in ("shard_of", "stream_for", "all_streams", "queue", "consumer"):
            continue  # (a number, the same key by its session, all shards, RQ's queue name, a consumer's name)
        if isinstance(member, property):
            built[name] = getattr(k, name)
        elif callable(member):
            [param] = list(inspect.signature(member).parameters)[1:]
            built[name] = getattr(k, name)(placeholder[param])
    assert len(built) >= 28, sorted(built)  # (the filter above did not drop the builders)
    rows = set(re.findall(r"^\| `([^`]+)` \|", section, re.M))
    missing = {name: key for name, key in built.items() if key not in rows}
    assert not missing, f"keys not in OPERATIONS.md's Redis keys: {missing}"
    first_cells = re.findall(r"^\| (`[^|]+`) \|", section, re.M)
    state_rows = {name for cell in first_cells for name in re.findall(r"`(\w+)`", cell)}
    assert not {f.name for f in fields(SessionState)} - state_rows, "state fields not in OPERATIONS.md"
