"""Speculative decoding is configured the vLLM way (--speculative-config JSON, `LLM(speculative_config=...)`) or the
SGLang way (--speculative-* flags), never both; every bad value fails at EngineConfig construction with one
KestrelError naming it."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from kestrel.config import EngineConfig, add_engine_args, config_from_args
from kestrel.errors import KestrelError
from kestrel.speculative_config import SpeculativeConfig


@pytest.fixture
def drafter(tmp_path):
    path = tmp_path / "eagle3-drafter"
    path.mkdir()
    return str(path)


def cli(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_no_speculative_option_means_no_speculation():
    assert EngineConfig().speculative is None


def test_vllm_json_configures_eagle3_from_the_cli_and_from_llm_keywords(drafter):
    text = json.dumps({"method": "eagle3", "model": drafter, "num_speculative_tokens": 5})
    expected = SpeculativeConfig(method="eagle3", model=drafter, num_speculative_tokens=5)
    assert cli("--speculative-config", text).speculative == expected
    assert EngineConfig.from_kwargs(speculative_config=text).speculative == expected
    assert EngineConfig.from_kwargs(speculative_config=json.loads(text)).speculative == expected


@pytest.mark.parametrize("spelling", ["eagle3", "EAGLE3", "eagle-3", "Eagle_3"])
def test_method_names_are_case_and_dash_insensitive(drafter, spelling):
    assert EngineConfig(speculative_config={"method": spelling, "model": drafter}).speculative.method == "eagle3"


def test_ngram_takes_vllm_prompt_lookup_keys_and_defaults_to_three_tokens():
    spec = EngineConfig(speculative_config='{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 5}'
                        ).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 3, 3, 5)
    assert spec.num_draft_nodes == 3 and not spec.is_tree
    assert EngineConfig(speculative_config={"method": "[ngram]"}).speculative.method == "ngram"
    assert EngineConfig(speculative_config={"model": "[ngram]"}).speculative.method == "ngram"


def test_kestrel_json_keys_set_tree_shape_synthetic_rate_and_adaptivity(drafter):
    spec = EngineConfig(speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 3,
                                            "topk": 4, "num_draft_tokens": 10, "synthetic_acceptance_rate": 0.7,
                                            "adaptive": False}).speculative
    assert (spec.topk, spec.num_draft_nodes, spec.synthetic_acceptance_rate, spec.adaptive, spec.is_tree) == \
        (4, 10, 0.7, False, True)


def test_sglang_flags_configure_a_chain_whose_draft_token_count_includes_the_root(drafter):
    spec = cli("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
               "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "4").speculative
    assert spec == SpeculativeConfig(method="eagle3", model=drafter, num_speculative_tokens=3, topk=1,
                                     num_draft_tokens=3)


def test_sglang_flags_configure_a_tree(drafter):
    spec = cli("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
               "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
               "--speculative-num-draft-tokens", "11").speculative
    assert (spec.num_speculative_tokens, spec.topk, spec.num_draft_nodes) == (3, 4, 10)
    assert EngineConfig(speculative_algorithm="EAGLE3", speculative_draft_model_path=drafter,
                        speculative_eagle_topk=2).speculative.num_draft_nodes == 6   # unset: topk * K


def test_kestrel_flags_go_with_either_form(drafter):
    spec = cli("--speculative-algorithm", "NGRAM", "--speculative-disable-adaptive",
               "--speculative-synthetic-acceptance-rate", "0.5").speculative
    assert (spec.method, spec.adaptive, spec.synthetic_acceptance_rate) == ("ngram", False, 0.5)
    spec = cli("--speculative-config", '{"method": "ngram"}', "--speculative-disable-adaptive").speculative
    assert not spec.adaptive


def test_engine_config_stays_frozen(drafter):
    config = EngineConfig(speculative_config={"method": "ngram"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.speculative_config = None


@pytest.mark.parametrize("options, message", [
    (dict(speculative_config='{"method": "ngram"}', speculative_algorithm="NGRAM"), "configured twice"),
    (dict(speculative_config={"method": "ngram", "lookahead": 2}), "unknown --speculative-config key(s) ['lookahead']"),
    (dict(speculative_config="{method: ngram}"), "not valid JSON"),
    (dict(speculative_config="[1, 2]"), "must be a JSON object"),
    (dict(speculative_config={"num_speculative_tokens": 2}), "needs \"method\""),
    (dict(speculative_config={"method": "medusa"}),
     "'medusa' is not supported: expected one of ('eagle3', 'ngram', 'deepseek_mtp')"),
    (dict(speculative_algorithm="EAGLE"), "'eagle' is not supported"),
    (dict(model="smollm2", speculative_algorithm="EAGLE3"), "eagle3 needs the drafter's directory"),
    (dict(model="smollm2", speculative_config={"method": "eagle3"}), "eagle3 needs the drafter's directory"),
    (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/no/such/dir"), "is not a directory"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/x"), "takes no model"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=0), "--speculative-num-steps) 0 is invalid"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=17), "expected 1..16"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2), "ngram drafts a chain"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3), "must equal num_speculative_tokens 3"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1), "expected >= 2"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}), "1 <= min <= max"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_min": 0}), "1 <= min <= max"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": "3"}), "must be an integer"),
    (dict(speculative_config={"method": "ngram", "adaptive": "no"}), "must be true or false"),
    (dict(speculative_algorithm="NGRAM", speculative_synthetic_acceptance_rate=1.5), "expected a probability"),
    (dict(speculative_num_steps=3), "without --speculative-algorithm"),
    (dict(speculative_disable_adaptive=True), "without --speculative-algorithm"),
    (dict(speculative_config={"method": "ngram", "adaptive": True}, speculative_disable_adaptive=True),
     "adaptive set twice"),
])
def test_each_bad_option_fails_at_construction_with_one_message(options, message):
    with pytest.raises(KestrelError) as err:
        EngineConfig(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("options, message", [
    (dict(speculative_eagle_topk=0), "topk (--speculative-eagle-topk) 0 is invalid"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=3), "expected 3..6 draft tokens"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=12), "expected 3..6 draft tokens"),
    (dict(speculative_config={"prompt_lookup_min": 2}), "apply to method ngram only"),
])
def test_bad_eagle3_tree_options_fail_with_one_message(drafter, options, message):
    if "speculative_config" in options:
        options = dict(speculative_config=options["speculative_config"] | {"method": "eagle3", "model": drafter})
    else:
        options = options | dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=drafter,
                        speculative_num_steps=3 if "speculative_num_draft_tokens" in options else None)
    with pytest.raises(KestrelError) as err:
        EngineConfig(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_default_model_drafts_with_its_shipped_drafter_when_none_is_named():
    from kestrel.config import DEFAULT_DRAFTER_DIR

    assert (DEFAULT_DRAFTER_DIR / "config.json").is_file(), "models/kestrel-tiny-eagle3 ships with the repo"
    for options in (dict(speculative_algorithm="EAGLE3"), dict(speculative_config={"method": "eagle3"})):
        assert EngineConfig(**options).speculative.model == str(DEFAULT_DRAFTER_DIR)
    named = EngineConfig(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_DRAFTER_DIR))
    assert named.speculative.model == str(DEFAULT_DRAFTER_DIR)
