"""SpeculativeConfig: what to draft and how much, from vLLM's `--speculative-config '{json}'` or SGLang's
`--speculative-*` flags (never both). Torch-free: the server process parses it too.

Terms, with SGLang's names beside them:
    K = num_speculative_tokens (SGLang --speculative-num-steps): drafting steps, the depth of the chain or tree
    topk (--speculative-eagle-topk): children kept per node at each step; 1 = a chain
    num_draft_tokens: draft tokens sent to verification, the tree's node count, the root excluded. SGLang's
        --speculative-num-draft-tokens counts the root (the last verified token) too, so it is this + 1.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kestrel.errors import KestrelError

METHODS = ("eagle3", "ngram")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_SPECULATIVE_TOKENS = 3
# Keys of the JSON form: vLLM's, then Kestrel's.
JSON_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "topk", "num_draft_tokens", "synthetic_acceptance_rate", "adaptive")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str                                 # eagle3 | ngram
    model: str | None = None                    # the EAGLE-3 drafter's directory; ngram has none
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS   # K: drafting steps (chain length, tree depth)
    topk: int = 1                               # children per node per step; 1 = chain
    num_draft_tokens: int | None = None         # tree nodes, root excluded; None: K (chain) or topk * K (tree)
    prompt_lookup_min: int = 2                  # ngram: shortest suffix matched
    prompt_lookup_max: int = 4                  # ngram: longest suffix matched
    synthetic_acceptance_rate: float | None = None   # benchmarks: accept each draft with this probability
    adaptive: bool = True                       # let the engine shorten K when drafts keep failing

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if self.method not in METHODS:
            raise KestrelError(f"speculative method {self.method!r} is not supported: expected one of {METHODS}")
        if self.method == "eagle3":
            if not self.model:
                raise KestrelError("speculative method eagle3 needs the drafter's directory: set \"model\" in "
                                   "--speculative-config or --speculative-draft-model-path (only the default "
                                   "model ships one; `kestrel train-eagle3` trains one for any model)")
            if not Path(self.model).is_dir():
                raise KestrelError(f"speculative drafter {self.model!r} is not a directory: expected an EAGLE-3 "
                                   "checkpoint directory (config.json + safetensors)")
        elif self.model is not None:
            # An error rather than ignoring it: a drafter path with ngram is most likely a typo in `method`.
            raise KestrelError(f"speculative method ngram drafts from the context and takes no model; "
                               f"got model {self.model!r} (did you mean method eagle3?)")
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise KestrelError(f"num_speculative_tokens (--speculative-num-steps) {k} is invalid: "
                               f"expected 1..{MAX_SPECULATIVE_TOKENS}")
        if self.topk < 1:
            raise KestrelError(f"speculative topk (--speculative-eagle-topk) {self.topk} is invalid: expected >= 1")
        if self.method == "ngram" and self.topk != 1:
            raise KestrelError(f"speculative method ngram drafts a chain: topk must be 1, got {self.topk}")
        n = self.num_draft_tokens
        if n is not None:
            if self.topk == 1 and n != k:
                raise KestrelError(f"num_draft_tokens {n} is invalid for a chain (topk 1): it must equal "
                                   f"num_speculative_tokens {k} (SGLang's --speculative-num-draft-tokens {k + 1})")
            if self.topk > 1 and not k <= n <= max_tree_nodes(k, self.topk):
                raise KestrelError(f"num_draft_tokens {n} is invalid for a tree of depth {k} and topk {self.topk}: "
                                   f"expected {k}..{max_tree_nodes(k, self.topk)} draft tokens, the root excluded "
                                   f"(SGLang's --speculative-num-draft-tokens {k + 1}.."
                                   f"{max_tree_nodes(k, self.topk) + 1})")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise KestrelError(f"prompt_lookup_min {self.prompt_lookup_min} / prompt_lookup_max "
                               f"{self.prompt_lookup_max} are invalid: expected 1 <= min <= max")
        rate = self.synthetic_acceptance_rate
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise KestrelError(f"synthetic acceptance rate {rate} is invalid: expected a probability in [0, 1]")

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @property
    def num_draft_nodes(self) -> int:
        """Draft tokens verified per step (the root excluded): K for a chain, the tree budget for a tree."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return self.num_speculative_tokens * self.topk


def max_tree_nodes(depth: int, topk: int) -> int:
    """Kestrel's draft tree (forward/draft_tree.py) holds topk candidates at each of its depth steps."""
    return depth * topk


def normalize_method(name: str) -> str:
    """'EAGLE3', 'eagle-3', 'Eagle_3' -> 'eagle3'; '[ngram]', 'NGRAM' -> 'ngram'; others are returned lowered."""
    return name.strip().strip("[]").lower().replace("-", "").replace("_", "")


def parse_speculative_json(value: str | dict, default_drafter: str | None = None,
                           resolve_drafter: Callable[[str], str] | None = None) -> SpeculativeConfig:
    """vLLM's --speculative-config (a JSON object) or `LLM(speculative_config={...})`, plus Kestrel's keys.
    default_drafter: the drafter eagle3 uses when "model" is not given (the default model ships one);
    resolve_drafter: a named drafter -> its directory (a Hub id -> its snapshot)."""
    value = _json_object(value)
    unknown = sorted(set(value) - set(JSON_KEYS))
    if unknown:
        raise KestrelError(f"unknown --speculative-config key(s) {unknown}; accepted: {list(JSON_KEYS)}")
    fields = dict(value)
    if "method" not in fields and str(fields.get("model", "")).strip() == "[ngram]":
        fields["method"] = fields.pop("model")     # vLLM's older spelling: "model": "[ngram]"
    if fields.get("method") is None:
        raise KestrelError(f"--speculative-config needs \"method\": one of {METHODS}")
    fields["method"] = normalize_method(str(fields["method"]))
    if fields["method"] != "ngram":
        given = sorted(k for k in ("prompt_lookup_min", "prompt_lookup_max") if k in fields)
        if given:
            raise KestrelError(f"--speculative-config keys {given} apply to method ngram only, "
                               f"not {fields['method']}")
    for key in ("num_speculative_tokens", "topk", "num_draft_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if fields.get(key) is not None and (isinstance(fields[key], bool) or not isinstance(fields[key], int)):
            raise KestrelError(f"--speculative-config {key!r} must be an integer, got {fields[key]!r}")
    rate = fields.get("synthetic_acceptance_rate")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))):
        raise KestrelError(f"--speculative-config 'synthetic_acceptance_rate' must be a number, got {rate!r}")
    if not isinstance(fields.get("adaptive", True), bool):
        raise KestrelError(f"--speculative-config 'adaptive' must be true or false, got {fields['adaptive']!r}")
    if fields.get("num_speculative_tokens") is None:
        fields["num_speculative_tokens"] = DEFAULT_SPECULATIVE_TOKENS
    if fields["method"] == "eagle3" and not fields.get("model"):
        fields["model"] = default_drafter
    elif fields["method"] == "eagle3" and resolve_drafter is not None and isinstance(fields["model"], str):
        fields["model"] = resolve_drafter(fields["model"])
    return SpeculativeConfig(**fields)


def drafter_name(speculative_config: str | dict | None, speculative_draft_model_path: str | None) -> str | None:
    """The drafter a user named, before anything is checked (the front doors fetch a Hub id's snapshot first):
    --speculative-draft-model-path, else --speculative-config's "model". None where there is none, or where the
    JSON is broken (building the config says what is wrong)."""
    if speculative_draft_model_path:
        return speculative_draft_model_path
    try:
        value = _json_object(speculative_config) if speculative_config else {}
    except KestrelError:
        return None
    model = value.get("model")
    return model if isinstance(model, str) and model.strip() != "[ngram]" else None


def resolve_speculative(speculative_config: str | dict | None, speculative_algorithm: str | None,
                        speculative_draft_model_path: str | None, speculative_num_steps: int | None,
                        speculative_eagle_topk: int | None, speculative_num_draft_tokens: int | None,
                        speculative_disable_adaptive: bool,
                        speculative_synthetic_acceptance_rate: float | None,
                        default_drafter: str | None = None,
                        resolve_drafter: Callable[[str], str] | None = None) -> SpeculativeConfig | None:
    """EngineConfig's speculative fields (named as the flags) -> a SpeculativeConfig, or None when off.
    default_drafter: the EAGLE-3 drafter used when none is named (the default model's shipped one);
    resolve_drafter: a named drafter -> its directory (models/names.py: a Hub id -> its snapshot).

    The vLLM form (`speculative_config`) and the SGLang flags exclude each other; Kestrel's two flags
    (--speculative-disable-adaptive, --speculative-synthetic-acceptance-rate) go with either form."""
    sglang = {"--speculative-algorithm": speculative_algorithm,
              "--speculative-draft-model-path": speculative_draft_model_path,
              "--speculative-num-steps": speculative_num_steps,
              "--speculative-eagle-topk": speculative_eagle_topk,
              "--speculative-num-draft-tokens": speculative_num_draft_tokens}
    sglang_given = [flag for flag, v in sglang.items() if v is not None]
    kestrel_given = [flag for flag, given in (("--speculative-disable-adaptive", speculative_disable_adaptive),
                                              ("--speculative-synthetic-acceptance-rate",
                                               speculative_synthetic_acceptance_rate is not None)) if given]
    if speculative_config == "":
        speculative_config = None
    if speculative_config is not None and sglang_given:
        raise KestrelError(f"speculative decoding configured twice: --speculative-config and {sglang_given}; "
                           "use vLLM's JSON or SGLang's flags, not both")
    if speculative_config is not None:
        spec = parse_speculative_json(speculative_config, default_drafter, resolve_drafter)
        json_keys = set(_json_object(speculative_config))
        if speculative_disable_adaptive:
            if "adaptive" in json_keys:
                raise KestrelError("adaptive set twice: --speculative-config \"adaptive\" and "
                                   "--speculative-disable-adaptive")
            spec = dataclasses.replace(spec, adaptive=False)
        if speculative_synthetic_acceptance_rate is not None:
            if "synthetic_acceptance_rate" in json_keys:
                raise KestrelError("synthetic acceptance rate set twice: --speculative-config "
                                   "\"synthetic_acceptance_rate\" and --speculative-synthetic-acceptance-rate")
            spec = dataclasses.replace(spec, synthetic_acceptance_rate=speculative_synthetic_acceptance_rate)
        return spec
    if speculative_algorithm is None:
        if sglang_given or kestrel_given:
            raise KestrelError(f"{sglang_given + kestrel_given} given without --speculative-algorithm "
                               f"(one of {[m.upper() for m in METHODS]}) or --speculative-config")
        return None
    method = normalize_method(speculative_algorithm)
    if speculative_num_draft_tokens is not None and speculative_num_draft_tokens < 2:
        raise KestrelError(f"--speculative-num-draft-tokens {speculative_num_draft_tokens} is invalid: it counts "
                           "the last verified token too, so expected >= 2")
    drafter = speculative_draft_model_path
    if drafter and method == "eagle3" and resolve_drafter is not None:
        drafter = resolve_drafter(drafter)
    return SpeculativeConfig(
        method=method,
        model=drafter or (default_drafter if method == "eagle3" else None),
        num_speculative_tokens=DEFAULT_SPECULATIVE_TOKENS if speculative_num_steps is None else speculative_num_steps,
        topk=1 if speculative_eagle_topk is None else speculative_eagle_topk,
        # SGLang counts the root (the last verified token) among the draft tokens; Kestrel does not.
        num_draft_tokens=None if speculative_num_draft_tokens is None else speculative_num_draft_tokens - 1,
        synthetic_acceptance_rate=speculative_synthetic_acceptance_rate,
        adaptive=not speculative_disable_adaptive,
    )


def _json_object(value: str | dict) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise KestrelError(f"--speculative-config is not valid JSON ({e.msg}): {value!r}") from None
    if not isinstance(value, dict):
        raise KestrelError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    return value
