"""Wire messages: round trips and strict decoding (fast, pure logic)."""

from __future__ import annotations

import msgpack
import pytest

from protocol.messages import (
    ErrorEvent,
    MessageDecodeError,
    RequestMessage,
    TokenEvent,
    decode_event,
)
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams


def _request() -> RequestMessage:
    return RequestMessage.make("r1", "m", [1, 2, 3], SamplingParams(max_tokens=5, stop=["x"]), priority=2)


def test_request_round_trips_with_its_sampling_params() -> None:
    message = RequestMessage.decode(_request().encode())
    assert message == _request()
    assert message.sampling_params() == SamplingParams(max_tokens=5, stop=["x"])


def test_events_round_trip_and_dispatch_on_type() -> None:
    token = TokenEvent("r1", 3, [5], "hi", finish_reason="stop", usage={"prompt_tokens": 1})
    error = ErrorEvent("r1", 4, "expired", "deadline passed")
    assert decode_event(token.encode()) == token
    assert decode_event(error.encode()) == error


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",  # not msgpack
        msgpack.packb([1, 2]),  # not a map
        # complete but for its version
        msgpack.packb({"v": 99, "req_id": "r", "model": "m", "prompt_token_ids": [1], "sampling": {}}),
        msgpack.packb({"v": 1, "req_id": "r", "model": "m", "prompt_token_ids": [1], "sampling": {},
                       "surprise": 1}),  # unknown field
        msgpack.packb({"v": 1, "req_id": "r", "model": "m", "sampling": {}}),  # missing field
        msgpack.packb({"v": 1, "req_id": "r", "model": "m", "prompt_token_ids": ["a"], "sampling": {}}),
    ],
)
def test_strict_decoding_rejects_what_it_does_not_understand(payload: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        RequestMessage.decode(payload)


def test_bad_sampling_values_name_the_field() -> None:
    message = RequestMessage("r", "m", [1], {"top_p": 3.0})
    with pytest.raises(InvalidRequestError, match="top_p"):
        message.sampling_params()
    with pytest.raises(MessageDecodeError, match="unknown sampling fields"):
        RequestMessage("r", "m", [1], {"nucleus": 0.5}).sampling_params()


def test_an_embedding_request_travels_with_its_pooling_params():
    from shared.pooling_params import POOLING_SAMPLING, PoolingParams

    message = RequestMessage.make_embedding("e1", "bge", [101, 7, 102], PoolingParams(dimensions=256),
                                            kind="batch", tenant="acme")
    back = RequestMessage.decode(message.encode())
    assert back.pooling_params() == PoolingParams(dimensions=256)
    assert back.sampling_params() == POOLING_SAMPLING and back.tenant == "acme"
    assert RequestMessage.make("g1", "m", [1], POOLING_SAMPLING).pooling_params() is None
    odd = RequestMessage.make_embedding("e2", "bge", [1], PoolingParams())
    odd.pooling = {"dimensions": None, "task": "embed", "normalize": False}
    with pytest.raises(MessageDecodeError, match="normalize"):
        RequestMessage.decode(odd.encode()).pooling_params()
