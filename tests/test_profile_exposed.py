"""The decode profile's exposed time (each kernel's share of the busy span when PDL makes durations overlap) and
the A/B summary table built from the profile stage's JSON."""
from benchmarks.profile_decode import exposed_time


def test_overlapping_launches_count_only_the_time_they_add_and_shares_sum_to_the_busy_span():
    events = [("matmul", 0.0, 10.0),     # 0-10
              ("decode", 5.0, 10.0),     # waits under PDL from 5; adds 10-15
              ("norm", 20.0, 2.0),       # after an idle gap of 5: adds its whole 2
              ("decode", 20.5, 0.5),     # inside norm's span: adds nothing
              ("matmul", 21.0, 4.0)]     # adds 22-25
    exposed = exposed_time(events)
    assert exposed == {"matmul": 13.0, "decode": 5.0, "norm": 2.0}
    assert sum(exposed.values()) == 25.0 - 5.0   # span minus the idle gap


def test_ab_summary_sets_each_switch_against_its_models_baseline(tmp_path):
    import json

    from benchmarks.ab_summary import ab_rows, markdown
    (tmp_path / "profile.json").write_text(json.dumps([{"model": "qwen3-0.6b", "engine_step_ms": 0.8},
                                                       {"model": "llama-3.1-8b", "engine_step_ms": 4.0}]))
    (tmp_path / "profile_ab_qwen3-0.6b_KESTREL_X_1.json").write_text(json.dumps([{
        "model": "qwen3-0.6b", "engine_step_ms": 0.72,
        "kernels": [{"name": "_decode_kernel", "exposed_us_each": 6.5}, {"name": "other", "exposed_us_each": 1.0}]}]))
    (tmp_path / "profile_ab_llama-3.1-8b_KESTREL_Y_0.json").write_text(
        json.dumps([{"model": "llama-3.1-8b", "engine_step_ms": 4.2}]))
    (tmp_path / "profile_ab_other_KESTREL_Z_1.json").write_text(json.dumps([{"model": "other", "engine_step_ms": 1}]))
    rows = {r["switch"]: r for r in ab_rows(tmp_path)}
    assert set(rows) == {"KESTREL_X_1", "KESTREL_Y_0"}   # no baseline, no row
    assert round(rows["KESTREL_X_1"]["change_pct"], 6) == -10.0 and round(rows["KESTREL_Y_0"]["change_pct"], 6) == 5.0
    assert rows["KESTREL_X_1"]["decode_exposed_us"] == 6.5 and rows["KESTREL_X_1"]["skinny_exposed_us"] is None
    assert "| qwen3-0.6b | KESTREL_X_1 | 0.720 | 0.800 | -10.0% |  | 6.50 |" in markdown(list(rows.values()))


def test_slot_table_splits_a_kernel_by_its_place_in_the_layer():
    from benchmarks.profile_decode import slot_table
    # 2 steps x 2 layers; per layer: matmul (slot 0), attn, matmul (slot 1); slot 1 always runs 3 us, slot 0 1 us
    events, t = [], 0.0
    for _ in range(2 * 2):
        for name, dur in (("matmul", 1.0), ("attn", 2.0), ("matmul", 3.0)):
            events.append((name, t, dur))
            t += dur
    rows = {(r["name"], r["slot"]): r for r in slot_table(events, steps=2, num_layers=2)}
    assert set(rows) == {("matmul", 0), ("matmul", 1)}   # attn runs once a layer: no slots
    assert rows[("matmul", 0)]["exposed_us_each"] == 1.0 and rows[("matmul", 1)]["exposed_us_each"] == 3.0
    assert rows[("matmul", 1)]["after"] == "attn"


def test_profile_ablations_stand_in_for_decode_attention_and_the_prologue():
    import pytest
    import torch

    from benchmarks.profile_decode import ablations
    from kestrel.attention import cluster_decode, triton_kernels
    triton_decode, cluster, (prologue_mod, prologue_attr, prologue) = ablations("decode,prologue")
    assert [p[:2] for p in (triton_decode, cluster)] == [(triton_kernels, "decode_attention"),
                                                        (cluster_decode, "decode_attention")]
    assert prologue_attr == "qk_norm_rope_store" and callable(getattr(prologue_mod, prologue_attr))
    q = torch.randn(3, 4, 8)
    assert triton_decode[2](q, None, None, None, None, 0.1, partials=None) is q
    assert cluster[2](q, None, None, None, None, 0.1) is q
    qkv = torch.randn(3, (4 + 2 * 2) * 8)
    got = prologue(qkv, None, None, 0.0, None, None, None, None, None, 4, 2, 8)
    assert got.shape == (3, 4, 8) and torch.equal(got.reshape(3, -1), qkv[:, :32])
    assert ablations("") == []
    with pytest.raises(SystemExit, match="unknown"):
        ablations("decode,attention")


def test_profile_ablations_take_the_folded_norm_and_silu_out_of_the_skinny_matmuls(monkeypatch):
    """With the ablation the matmul keeps its weight and shape: qkv/gate_up read the hidden state as it is, down
    reads the gate half of gate_up, both through the plain skinny gemv (its torch reference stands in for the
    kernel here; tests/test_gemv.py holds the kernel to it)."""
    import torch

    from benchmarks.profile_decode import ablations
    from kestrel.layers import gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w, bias=None, config=None: gemv.gemv_ref(x, w, bias))
    (_, norm_attr, no_norm), (_, silu_attr, no_silu) = ablations("norm,silu")
    assert (norm_attr, silu_attr) == ("add_rms_norm_gemv", "silu_mul_gemv")
    torch.manual_seed(0)
    x, residual, w = torch.randn(1, 32), torch.randn(1, 32), torch.randn(16, 32)
    out, res = no_norm(x, residual, torch.ones(32), 1e-6, w)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-4, atol=1e-4)
    assert res is residual and no_norm(x, None, torch.ones(32), 1e-6, w)[1] is x
    gate_up, w_down = torch.randn(1, 64), torch.randn(16, 32)
    torch.testing.assert_close(no_silu(gate_up, w_down), gate_up[:, :32] @ w_down.T, rtol=1e-4, atol=1e-4)


def test_profile_ablation_of_the_cluster_merge_builds_the_kernel_without_it():
    """`cluster_merge`: the cluster decode kernel is built with MERGE=0 (its programs never read a peer)."""
    from benchmarks.profile_decode import ablations
    from kestrel.attention import cluster_decode
    [(mod, attr, defines)] = ablations("cluster_merge")
    assert (mod, attr) == (cluster_decode, "defines")
    assert defines(2, 128, 8, 16, False, 4) == {**cluster_decode.defines(2, 128, 8, 16, False, 4), "MERGE": 0}
