"""The EAGLE-3 drafter as a trainable module: dense attention, the training-time test, the standard names.

The serving drafter (models/eagle3.py) runs on paged KV with fused kernels and no autograd; this one holds the same
weights under the checkpoint's own names (q/k/v and gate/up unmerged) so `state_dict()` is the file SGLang, vLLM
and Kestrel load, and it unrolls drafting as inference runs it.

Training-time test, for one sequence of T tokens (aux_t: the target's three captured states at position t):

    step 0, row t:  hidden fc(aux_t), token t + 1, rotary position t      -> predicts token t + 2
    step i, row t:  hidden = step i - 1's output at row t, token t + i + 1,
                    rotary position t + i                                  -> predicts token t + i + 2

Row t of step i is the drafter at position t + i after an extend that ended at t, so it attends to what that
drafter's KV cache holds then: step 0's keys at positions 0 .. t and its own earlier steps' keys at row t.

    keys:     K0[0] K0[1] ... K0[t] ... K0[T-1]   K1[t]   K2[t]  ...  Ki[t]
    mask:       1     1   ...   1   0 ...   0       1       1    ...    1      (query: step i, row t)

so the scores are one causal [T, T] block plus i diagonals, never a [T, i T] matrix.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.eagle3 import Eagle3Config

STEP_WEIGHT_DECAY = 0.8   # step i's loss weighs 0.8^i: later steps matter only when the earlier ones were accepted


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TrainableEagle3(nn.Module):
    """Parameters named as the standard checkpoint names them; the target's embedding is a frozen, unsaved buffer."""

    def __init__(self, cfg: Eagle3Config, target_embedding: torch.Tensor, draft_ids: torch.Tensor) -> None:
        super().__init__()
        assert target_embedding.shape == (cfg.vocab_size, cfg.hidden_size), target_embedding.shape
        self.config = cfg
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # draft id i is target id draft_ids[i]: d2t[i] = draft_ids[i] - i, t2d marks the target ids kept
        draft_ids = draft_ids.long().cpu()
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("d2t", draft_ids - torch.arange(cfg.draft_vocab_size))
        self.register_buffer("t2d", t2d)
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        self.register_buffer("embedding", target_embedding.detach().clone(), persistent=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama's init: matrices N(0, 0.02), norms 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The standard checkpoint's tensors (contiguous CPU copies; d2t int64, t2d bool)."""
        return {name: t.detach().cpu().contiguous() for name, t in self.state_dict().items()}

    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, num_steps: int
               ) -> list[torch.Tensor]:
        """The training-time test over a padded batch.

        aux [B, T, 3 Ht] target states; input_ids [B, T] the sequences; valid [B, T] real (not padding) tokens.
        Returns each step's draft logits [B, T, draft_vocab] (float32); step i's row t predicts token t + i + 2."""
        cfg, attn = self.config, self.midlayer.self_attn
        b, t = input_ids.shape
        hidden = self.fc(aux)
        positions = torch.arange(t, device=aux.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=aux.device).tril()
        key_ok = causal[None, None] & valid[:, None, None, :]              # [B, 1, T, T]
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []                 # each step's (K, V) [B, kv, T, D]
        logits = []
        for step in range(num_steps):
            # token t + step + 1 at row t: shifted left, the tail padded (those rows carry no loss)
            tokens = F.pad(input_ids[:, step + 1:], (0, step + 1), value=0)
            x = torch.cat([self.midlayer.input_layernorm(self.embedding[tokens].to(hidden.dtype)),
                           self.midlayer.hidden_norm(hidden)], dim=-1)
            q = attn.q_proj(x).view(b, t, attn.heads, attn.head_dim)
            k = attn.k_proj(x).view(b, t, attn.kv_heads, attn.head_dim)
            v = attn.v_proj(x).view(b, t, attn.kv_heads, attn.head_dim)
            pos = (positions + step).clamp(max=cfg.max_position_embeddings - 1).repeat(b)
            q, k = self.rotary(pos, q.reshape(b * t, attn.heads, -1), k.reshape(b * t, attn.kv_heads, -1))
            q = q.view(b, t, attn.heads, -1).transpose(1, 2)               # [B, heads, T, D]
            keys.append((k.view(b, t, attn.kv_heads, -1).transpose(1, 2), v.transpose(1, 2)))
            out = self._attend(q, keys, key_ok)                              # [B, T, heads * D]
            h1 = attn.o_proj(out) + hidden
            hidden = self.midlayer.mlp(self.midlayer.post_attention_layernorm(h1)) + h1
            logits.append(self.lm_head(self.norm(hidden)).float())
        return logits

    def _attend(self, q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]], key_ok: torch.Tensor
                ) -> torch.Tensor:
        """q [B, h, T, D] against step 0's keys (causal) and every later step's key at the same row."""
        attn = self.midlayer.self_attn
        group = attn.heads // attn.kv_heads
        scale = 1.0 / math.sqrt(attn.head_dim)
        b, h, t, d = q.shape
        qg = q.view(b, attn.kv_heads, group, t, d)                          # GQA: heads grouped by their KV head
        k0, v0 = keys[0]
        scores = [torch.einsum("bkgtd,bksd->bkgts", qg, k0).float() * scale]
        scores[0] = scores[0].masked_fill(~key_ok[:, :, None], float("-inf"))
        for k, _ in keys[1:]:
            scores.append((torch.einsum("bkgtd,bktd->bkgt", qg, k).float() * scale)[..., None])
        probs = torch.cat(scores, dim=-1).softmax(dim=-1).to(q.dtype)
        out = torch.einsum("bkgts,bksd->bkgtd", probs[..., :t], v0)
        for j, (_, v) in enumerate(keys[1:]):
            out = out + probs[..., t + j, None] * v[:, :, None]
        return out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


def ttt_loss(logits: list[torch.Tensor], target_logits: torch.Tensor, target_best: torch.Tensor,
             loss_mask: torch.Tensor, t2d: torch.Tensor, draft_ids: torch.Tensor
             ) -> tuple[torch.Tensor, list[float], list[float]]:
    """Forward KL from the target's distribution over the draft vocabulary, summed over steps with weights 0.8^i.

    target_logits [B, T, draft_vocab]: the target's logits at each position restricted to the draft vocabulary
    (row p predicts token p + 1); target_best [B, T]: the target's own argmax over its whole vocabulary;
    loss_mask [B, T]: token p is one the target generated (a response token). Step i's row t is scored against
    the target at position t + i + 1 where token t + i + 2 is a response token and the target's choice is in the
    draft vocabulary (otherwise no draft could match it). Returns (loss, per-step loss, per-step accuracy: the
    draft's argmax is the target's)."""
    total = target_logits.new_zeros((), dtype=torch.float32)
    losses, accs = [], []
    for step, draft in enumerate(logits):
        shift = step + 1
        target = F.pad(target_logits[:, shift:], (0, 0, 0, shift))                   # row t: position t + shift
        best = F.pad(target_best[:, shift:], (0, shift))
        bears = F.pad(loss_mask[:, shift + 1:], (0, shift + 1), value=False)         # token t + shift + 1
        mask = (bears & t2d[best]).float()
        per_row = -(target.float().softmax(dim=-1) * draft.log_softmax(dim=-1)).sum(dim=-1)
        denom = mask.sum().clamp(min=1.0)
        step_loss = (per_row * mask).sum() / denom
        total = total + STEP_WEIGHT_DECAY ** step * step_loss
        correct = (draft_ids[draft.argmax(dim=-1)] == best).float()
        losses.append(float(step_loss.detach()))
        accs.append(float((correct * mask).sum() / denom))
    return total, losses, accs
