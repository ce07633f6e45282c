"""KV block identity, pure and deterministic: vLLM-exact block hashing, the KV event codec and the KV index."""

from llmd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventDecoder, encode_batch
from llmd.kv.hashing import HASH_ALGOS, BlockHasher, event_hash
from llmd.kv.index import KVIndex, PrefixMatch

__all__ = [
    "HASH_ALGOS",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEventDecoder",
    "KVIndex",
    "PrefixMatch",
    "encode_batch",
    "event_hash",
]
