"""Prefix keys and the rendezvous choice of a replica (no Ray needed)."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from inlinelm.serve.prefix import choose, prefix_key, rank

SYSTEM = "You are a terse assistant. " * 20
REPLICAS = ["r-a", "r-b"]


def chat(*messages: tuple[str, object]) -> bytes:
    return orjson.dumps({"messages": [{"role": r, "content": c} for r, c in messages]})


def test_chats_sharing_a_system_prompt_share_a_key_whatever_the_user_asks() -> None:
    one = prefix_key("/v1/chat/completions", chat(("system", SYSTEM), ("user", "hi")))
    two = prefix_key("/v1/chat/completions", chat(("system", SYSTEM), ("user", "other")))
    other = prefix_key("/v1/chat/completions", chat(("system", "Be loud."), ("user", "hi")))
    assert one == two == SYSTEM
    assert other != one


def test_a_chat_without_a_system_prompt_is_keyed_by_its_first_user_turn() -> None:
    first = chat(("user", "plan a trip"))
    later = chat(("user", "plan a trip"), ("assistant", "where?"), ("user", "Kyoto"))
    assert prefix_key("/v1/chat/completions", first) == "plan a trip"
    assert prefix_key("/v1/chat/completions", later) == "plan a trip"


def test_content_parts_and_developer_messages_count_as_shared_text() -> None:
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    body = chat(("developer", parts), ("system", "Rule 2."), ("user", "x"))
    assert prefix_key("/v1/chat/completions", body) == "Be brief.\x00Rule 2."


def test_completion_keys_are_the_prompts_first_characters_or_token_ids() -> None:
    path = "/v1/completions"
    long = "x" * 5000
    assert prefix_key(path, orjson.dumps({"prompt": long}), prefix_chars=100) == "x" * 100
    assert prefix_key(path, orjson.dumps({"prompt": ["first", "second"]})) == "first"
    assert prefix_key(path, orjson.dumps({"prompt": list(range(600))}), prefix_chars=40) == (
        ",".join(map(str, range(10)))
    )
    assert prefix_key(path, orjson.dumps({"prompt": [[5, 6], [7]]})) == "5,6"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", orjson.dumps({"messages": "hi"})),
        ("/v1/chat/completions", orjson.dumps({"messages": []})),
        ("/v1/chat/completions", chat(("assistant", "only me"))),
        ("/v1/completions", orjson.dumps({"prompt": 5})),
        ("/v1/completions", orjson.dumps({"prompt": ""})),
        ("/v1/completions", orjson.dumps({"prompt": [1, "a"]})),
        ("/v1/models", b""),
        ("/tokenize", orjson.dumps({"prompt": "hi"})),
    ],
)
def test_a_request_with_no_readable_prompt_has_no_key(path: str, body: bytes) -> None:
    assert prefix_key(path, body) is None


def test_a_key_keeps_its_replica_and_keys_spread_over_replicas() -> None:
    loads = dict.fromkeys(REPLICAS, 0.0)
    chosen = {f"prompt {i}": choose(f"prompt {i}", loads) for i in range(1000)}
    assert all(choose(key, loads) == replica for key, replica in chosen.items())
    spread = Counter(chosen.values())
    assert set(spread) == set(REPLICAS)
    assert min(spread.values()) > 400  # rendezvous hashing splits keys about evenly


def test_losing_a_replica_moves_only_the_keys_it_held() -> None:
    three = ["r-a", "r-b", "r-c"]
    keys = [f"system {i}" for i in range(300)]
    before = {k: rank(k, three)[0] for k in keys}
    after = {k: rank(k, ["r-a", "r-c"])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r-b"}
    assert moved  # the test would pass vacuously if r-b held nothing


def test_adding_a_replica_moves_to_it_only_the_keys_it_wins() -> None:
    keys = [f"system {i}" for i in range(300)]
    before = {k: rank(k, ["r-a", "r-b"])[0] for k in keys}
    after = {k: rank(k, ["r-a", "r-b", "r-c"])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved and all(after[k] == "r-c" for k in moved)


def test_the_preferred_replica_is_kept_up_to_the_load_bound_then_the_least_loaded_wins() -> None:
    key = "shared system prompt"
    preferred, other = rank(key, REPLICAS)
    # mean of (p, 0) is p/2; preferred keeps the key while p <= p/2 + bound, i.e. p <= 2*bound
    assert choose(key, {preferred: 8, other: 0}, max_imbalance=4) == preferred
    assert choose(key, {preferred: 9, other: 0}, max_imbalance=4) == other
    assert choose(key, {preferred: 30, other: 25}, max_imbalance=4) == preferred


def test_a_request_without_a_key_goes_to_the_least_loaded_replica() -> None:
    assert choose(None, {"r-a": 3, "r-b": 1, "r-c": 2}) == "r-b"
    with pytest.raises(ValueError, match="no replica"):
        choose("k", {})
