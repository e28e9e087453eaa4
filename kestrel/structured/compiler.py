"""The model's vocabulary as xgrammar sees it (TokenizerInfo, built once) and the grammar compiler over it.

Compiling turns a grammar into per-state token masks over the whole vocabulary: milliseconds for a small vocabulary,
more for 150k tokens and a large schema. Compiled grammars are cached by their StructuredOutput (a schema sent
again is not compiled again), and compiling runs on a worker thread: the engine starts it when a request arrives
and waits for it only when the request's first token is sampled, after its prefill.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kestrel.sampling_params import StructuredOutput
from kestrel.structured.grammar import JSON_OBJECT_SCHEMA, choice_ebnf, validate


MAX_CACHED = 512   # compiled grammars kept (a JSON schema's is tens of kB to a few MB)


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's TokenizerInfo for the model: `vocab_size` is the model's (the logits' width, which may exceed the
    tokenizer's: padding rows are never allowed); `stop_token_ids` end a grammar (the engine's EOS ids).

    Kestrel's own FastTokenizer (a `tokenizers.Tokenizer` underneath, no transformers) is read through the same
    detection xgrammar applies to a transformers fast tokenizer: its serialized backend gives the vocabulary's
    encoding (byte-level, byte-fallback, raw) and whether a prefix space is added."""
    import xgrammar as xgr

    backend = getattr(hf_tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
    encoded = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=metadata["add_prefix_space"])


class GrammarCompiler:
    """Compiled grammars for one model, by StructuredOutput. Thread-safe; `compile_async` is what the engine calls."""

    def __init__(self, info) -> None:
        import xgrammar as xgr

        self.info = info
        self.vocab_size: int = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.batch = xgr.BatchGrammarMatcher()   # fills a step's mask rows in parallel (matcher.plain_bitmask)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kestrel-grammar")
        self._compiled: OrderedDict[StructuredOutput, Future] = OrderedDict()   # least recently used first
        self._lock = threading.Lock()
        self.num_compiled = 0   # grammars compiled (not served from the cache): tests read it

    def compile_async(self, so: StructuredOutput) -> Future:
        """The compiled grammar, as a future (done at once for one compiled before). Raises KestrelError now for a
        constraint xgrammar cannot parse (validate: cheap, cached)."""
        validate(so)
        with self._lock:
            future = self._compiled.get(so)
            if future is None:
                future = self._compiled[so] = self._pool.submit(self._compile, so)
                if len(self._compiled) > MAX_CACHED:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(so)
            return future

    def compile(self, so: StructuredOutput):
        return self.compile_async(so).result()

    def _compile(self, so: StructuredOutput):
        self.num_compiled += 1
        c = self._compiler
        if so.json_schema is not None:
            return c.compile_json_schema(so.json_schema, any_whitespace=False)
        if so.json_object:
            return c.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
        if so.regex is not None:
            return c.compile_regex(so.regex)
        if so.choice is not None:
            return c.compile_grammar(choice_ebnf(so.choice))
        return c.compile_grammar(so.grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
