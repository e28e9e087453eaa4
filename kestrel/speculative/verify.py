"""Lossless verification of drafted tokens (speculative sampling): the tokens that leave have exactly the
distribution the sampler would have drawn them from, one token at a time.

The target's distribution at each verified position is the sampler's (forward/sampler.py): temperature, then
top-k / top-p / min-p, softmax; a greedy row (temperature <= GREEDY_TEMPERATURE) is one-hot at the argmax, so the same
acceptance rule that is lossless for sampling accepts exactly the drafts that equal the argmax.

    chain (verify_chain): drafts d_1..d_K of a sequence, logits rows laid out per sequence as
        row b*(K+1) + j = the target's logits after the j-th token of the verify chunk [last, d_1, .., d_K],
        i.e. the distribution p_j that d_(j+1) is checked against; row b*(K+1) + K gives the bonus token.
    tree (verify_tree): N draft nodes per sequence in BFS order, `parents[b, i]` the index of node i's parent
        (-1: a child of the root, the sequence's last verified token);
        row b*(N+1) = the root's logits, row b*(N+1) + 1 + i = node i's.

Random draws: one uniform per decision and one exponential per vocabulary entry for the last token, each row's
from its own generator when the request is seeded (the same draws in the same order on every run).
"""
from __future__ import annotations

import torch

from kestrel.forward.sampler import SamplingBatch, apply_top_k_top_p_min_p
from kestrel.sampling_params import GREEDY_TEMPERATURE


def expand_sampling(s: SamplingBatch, repeats: int) -> SamplingBatch:
    """Row b's settings for each of its `repeats` consecutive positions (rows b*repeats .. b*repeats+repeats-1)."""
    return SamplingBatch(
        temperature=s.temperature.repeat_interleave(repeats),
        top_k=s.top_k.repeat_interleave(repeats),
        top_p=s.top_p.repeat_interleave(repeats),
        min_p=s.min_p.repeat_interleave(repeats),
        generators=[g for g in s.generators for _ in range(repeats)],
        all_greedy=s.all_greedy,
        needs_top_k=s.needs_top_k,
        needs_top_p=s.needs_top_p,
        needs_min_p=s.needs_min_p,
        max_logprobs=s.max_logprobs,
    )


def target_probs(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> the distribution the sampler draws each row from [N, V] (greedy rows one-hot)."""
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if s.all_greedy:
        return one_hot
    greedy = s.temperature <= GREEDY_TEMPERATURE
    temperature = torch.where(greedy, torch.ones_like(s.temperature), s.temperature)
    probs = apply_top_k_top_p_min_p(logits / temperature[:, None], s).softmax(dim=-1)
    return torch.where(greedy[:, None], one_hot, probs)


def verify_chain(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor, sampling: SamplingBatch,
                 draft_probs: torch.Tensor | None = None, synthetic_acceptance_rate: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over a chain (Leviathan et al. 2023, Chen et al. 2023).

    logits [B*(K+1), V] float32, draft_tokens [B, K] int64 (-1 past a row's num_drafts), num_drafts [B],
    sampling: B rows; draft_probs [B, K, V]: the distribution q each draft was drawn from (None: the drafts are
    deterministic, q one-hot). Draft j is accepted with probability min(1, p_j(d)/q_j(d)); the first rejected one
    is replaced by a draw from normalize(max(p_j - q_j, 0)); if all are accepted a bonus token comes from p_K.
    `synthetic_acceptance_rate` (benchmarks) accepts each draft with that probability whatever the tokens, and
    draws the last token from p.

    Returns (num_accepted [B] int64, tokens [B, K+1] int64: the accepted drafts, then the one target token, -1 after).
    """
    batch, k = draft_tokens.shape
    device = logits.device
    positions = torch.arange(k, device=device)
    if sampling.all_greedy and draft_probs is None:   # every p one-hot: the same rule, without [B, V] tensors
        return _verify_greedy_chain(logits.argmax(dim=-1).view(batch, k + 1), draft_tokens, num_drafts, sampling,
                                    synthetic_acceptance_rate)
    p = target_probs(logits, expand_sampling(sampling, k + 1)).view(batch, k + 1, -1)
    rows = torch.arange(batch, device=device)
    drafts = draft_tokens.clamp(min=0)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)                    # [B, K]
    if sampling.all_greedy and synthetic_acceptance_rate is None:
        uniforms = torch.full((batch, k), 0.5, device=device)   # greedy decisions are certain; no draws
    else:
        uniforms = _uniforms(sampling, k, device)
    if synthetic_acceptance_rate is not None:
        accepted = uniforms < synthetic_acceptance_rate
    elif draft_probs is None:
        accepted = uniforms < p_draft
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        accepted = uniforms * q_draft < p_draft                  # u < p/q without dividing by a zero q
    accepted &= positions < num_drafts[:, None]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # drafts up to the first rejection

    # The last token: from p where every draft was accepted, from the residual of p after the rejected draft else.
    last_probs = p[rows, num_accepted]                                               # [B, V]
    if synthetic_acceptance_rate is None and k > 0:
        rejected_at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_rejected = torch.zeros_like(last_probs).scatter_(-1, drafts[rows, rejected_at][:, None], 1.0)
        else:
            q_rejected = draft_probs[rows, rejected_at]
        residual = _nonzero_or((last_probs - q_rejected).clamp(min=0), last_probs)
        last_probs = torch.where((num_accepted < num_drafts)[:, None], residual, last_probs)
    last = _draw(last_probs, sampling)

    tokens = torch.where(positions < num_accepted[:, None], draft_tokens, -1)
    tokens = torch.cat([tokens, torch.full((batch, 1), -1, dtype=tokens.dtype, device=device)], dim=1)
    tokens.scatter_(1, num_accepted[:, None], last[:, None].to(tokens.dtype))
    return num_accepted, tokens


def _verify_greedy_chain(target: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                         sampling: SamplingBatch, synthetic_acceptance_rate: float | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_chain when every row is greedy and the drafts deterministic: p_j is one-hot at target[:, j], so a
    draft is accepted iff it is the argmax, and the residual after a rejection is the argmax again."""
    batch, k = draft_tokens.shape
    positions = torch.arange(k, device=target.device)
    if synthetic_acceptance_rate is not None:
        accepted = _uniforms(sampling, k, target.device) < synthetic_acceptance_rate
    else:
        accepted = draft_tokens == target[:, :k]
    accepted &= positions < num_drafts[:, None]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    tokens = torch.where(positions < num_accepted[:, None], draft_tokens, -1)
    tokens = torch.cat([tokens, torch.full((batch, 1), -1, dtype=tokens.dtype, device=target.device)], dim=1)
    tokens.scatter_(1, num_accepted[:, None], target.gather(1, num_accepted[:, None]))
    return num_accepted, tokens


def verify_tree(logits: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, sampling: SamplingBatch
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft verification of a token tree with deterministic drafts (SpecInfer; SGLang's tree sampling).

    logits [B*(N+1), V] float32, parents [B, N] int64 (-1: a child of the root), tokens [B, N] int64 (-1: no
    node), nodes in BFS order (a parent before its children). At the current node, its children are tried in
    index order: child c is accepted with probability r(c) / sum(r), r the residual (at first the target's
    distribution at the node); a rejection removes c's mass from r. An accepted child becomes the current node;
    when every child is rejected (or there is none: a leaf) the last token is drawn from r. Each token that leaves
    thus has the target's distribution. Greedy rows follow the child equal to the argmax.

    Returns (num_accepted [B], tokens [B, D+1]: the accepted path's tokens then the target's one, -1 after,
    accepted_nodes [B, D]: the path's node indices, -1 after), D the deepest node of the batch.
    A loop over depth and, inside, over each node's children by rank; every step covers the whole batch.
    """
    batch, n = tokens.shape
    device = logits.device
    p = target_probs(logits, expand_sampling(sampling, n + 1)).view(batch, n + 1, -1)
    rows = torch.arange(batch, device=device)
    is_node = tokens >= 0
    depth, rank = _tree_shape(parents, is_node)
    # One read-back for the loop bounds: the tree's depth and the most children any node has.
    max_depth, max_children = torch.stack([depth.max(), rank.max() + 1]).tolist() if n else (0, 0)
    if sampling.all_greedy:
        uniforms = torch.full((batch, max_depth * max_children), 0.5, device=device)
    else:
        uniforms = _uniforms(sampling, max_depth * max_children, device)
    uniforms = uniforms.view(batch, max_depth, max_children)

    current = torch.full((batch,), -1, dtype=torch.long, device=device)    # -1: the root
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    residual = p[:, 0]
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    path_tokens = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    path_nodes = torch.full((batch, max_depth), -1, dtype=torch.long, device=device)
    node_tokens = tokens.clamp(min=0)
    for d in range(max_depth):
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        for c in range(max_children):
            is_child = is_node & (parents == current[:, None]) & (rank == c)     # [B, N]: the c-th child
            trying = is_child.any(dim=-1) & ~stopped & ~moved
            child = is_child.long().argmax(dim=-1)
            token = node_tokens[rows, child]
            accept = trying & (uniforms[:, d, c] * residual.sum(dim=-1) < residual[rows, token])
            reject = trying & ~accept
            residual = torch.where(reject[:, None], residual.scatter(-1, token[:, None], 0.0), residual)
            moved |= accept
            current = torch.where(accept, child, current)
            path_nodes[:, d] = torch.where(accept, child, path_nodes[:, d])
            path_tokens[:, d] = torch.where(accept, token, path_tokens[:, d])
        num_accepted += moved
        stopped |= ~moved
        residual = torch.where(moved[:, None], p[rows, current + 1], residual)
    node_probs = p[rows, current + 1]
    last = _draw(_nonzero_or(residual, node_probs), sampling)
    path_tokens.scatter_(1, num_accepted[:, None], last[:, None])
    return num_accepted, path_tokens, path_nodes


def _tree_shape(parents: torch.Tensor, is_node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [B, N]: 1 for the root's children, 0 for padding; rank [B, N]: a node's index among its siblings,
    -1 for padding)."""
    n = parents.shape[1]
    depth = torch.zeros_like(parents)
    for i in range(n):   # BFS order: a parent's depth is known before its children's
        above = depth.gather(1, parents[:, i:i + 1].clamp(min=0)).squeeze(1)
        depth[:, i] = torch.where(parents[:, i] >= 0, above + 1, 1)
    depth = torch.where(is_node, depth, 0)
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)     # [i, j]: j < i
    siblings = (parents[:, :, None] == parents[:, None, :]) & is_node[:, None, :] & earlier
    rank = torch.where(is_node, siblings.sum(dim=-1), -1)
    return depth, rank


def _uniforms(s: SamplingBatch, count: int, device: torch.device) -> torch.Tensor:
    """[B, count] uniforms in [0, 1); a seeded row's from its generator."""
    u = torch.rand(len(s.generators), count, device=device)
    for row, gen in enumerate(s.generators):
        if gen is not None:
            u[row].uniform_(generator=gen)
    return u


def _draw(probs: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """One token per row from probs [B, V] (unnormalized is fine), greedy rows the argmax; the sampler's
    exponential race: argmax(p / E), E ~ Exponential(1), draws from p / sum(p)."""
    greedy_tokens = probs.argmax(dim=-1)
    if s.all_greedy:
        return greedy_tokens
    noise = torch.empty_like(probs).exponential_()
    for row, gen in enumerate(s.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(s.temperature > GREEDY_TEMPERATURE, sampled, greedy_tokens)


def _nonzero_or(probs: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """A residual with no mass left comes only from rounding (its rejection had probability ~0): use the fallback."""
    return torch.where(probs.sum(dim=-1, keepdim=True) > 0, probs, fallback)
