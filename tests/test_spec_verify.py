"""Verification is lossless: whatever the drafts, the tokens that leave have the target's distribution (the one the
sampler draws from, top-k / top-p included); greedy rows keep the drafts that equal the argmax.

Distribution tests draw many independent rows in one batch and compare frequencies with the exact distribution by
total variation. With 20,000+ samples over at most 16 outcomes the expected TV is below 0.008; the bound is 0.02.
Two-token joints: when a step emits one token only, the second is what the next step would draw (the plain
sampler from p2(. | x)), so the joint must be p1(x) p2(y | x).
"""
from __future__ import annotations

import torch

from kestrel.forward.sampler import make_sampling_batch
from kestrel.speculative.verify import target_probs, verify_chain, verify_tree

TV_BOUND = 0.02


def batch(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None):
    temperatures = temperature if isinstance(temperature, list) else [temperature] * rows
    return make_sampling_batch(temperatures, [top_k] * rows, [top_p] * rows, [min_p] * rows,
                               generators or [None] * rows, 0, torch.device("cpu"))


def tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Total variation between the empirical distribution of `samples` (flat outcome ids) and `probs` (flat)."""
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * (freq - probs.double().flatten()).abs().sum().item()


def random_logits(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5


# --- greedy ---------------------------------------------------------------------------------------------------

def test_greedy_chain_keeps_the_leading_drafts_equal_to_the_argmax_then_the_argmax():
    k, vocab = 4, 50
    logits = random_logits(5 * (k + 1), vocab, seed=0)
    best = logits.argmax(-1).view(5, k + 1)
    drafts = best[:, :k].clone()
    drafts[1, 0] = (best[1, 0] + 1) % vocab            # wrong first draft
    drafts[2, 2] = (best[2, 2] + 1) % vocab            # wrong third draft
    drafts[3, 2:] = -1                                  # only two drafts
    drafts[4, 1] = (best[4, 1] + 1) % vocab            # wrong second draft, right ones after it
    num_drafts = torch.tensor([4, 4, 4, 2, 4])
    accepted, tokens = verify_chain(logits, drafts, num_drafts, batch(5, temperature=0.0))
    assert accepted.tolist() == [4, 0, 2, 2, 1]
    for row, n in enumerate(accepted.tolist()):
        assert tokens[row, :n].tolist() == drafts[row, :n].tolist()
        assert tokens[row, n].item() == best[row, n].item()
        assert (tokens[row, n + 1:] == -1).all()


def test_greedy_rows_of_a_sampled_batch_are_still_the_leading_match_rule():
    k, vocab = 3, 20
    logits = random_logits(2 * (k + 1), vocab, seed=1)
    best = logits.argmax(-1).view(2, k + 1)
    drafts = best[:, :k].clone()
    drafts[:, 1] = (best[:, 1] + 1) % vocab
    for seed in range(20):
        torch.manual_seed(seed)
        accepted, tokens = verify_chain(logits, drafts, torch.tensor([k, k]), batch(2, temperature=[0.0, 1.0]))
        assert accepted[0].item() == 1 and tokens[0].tolist() == [best[0, 0].item(), best[0, 1].item(), -1, -1]


def test_greedy_tree_follows_the_child_equal_to_the_argmax():
    vocab = 30
    #   root ─ n0 ─ n2
    #        └ n1 ─ n3 ─ n4
    parents = torch.tensor([[-1, -1, 0, 1, 3]])
    logits = random_logits(6, vocab, seed=2)
    best = logits.argmax(-1)                           # row 0: root, row 1 + i: node i
    other = lambda t: (t + 1) % vocab                  # noqa: E731
    tokens = torch.tensor([[other(best[0]), best[0], best[1], best[2], other(best[4])]])
    accepted, out, nodes = verify_tree(logits, parents, tokens, batch(1, temperature=0.0))
    assert accepted.tolist() == [2]
    assert nodes.tolist() == [[1, 3, -1]]
    assert out.tolist() == [[best[0].item(), best[2].item(), best[4].item(), -1]]


def test_a_chain_shaped_tree_verifies_like_the_chain_when_greedy():
    k, vocab, rows = 4, 6, 64
    logits = random_logits(rows * (k + 1), vocab, seed=3)
    best = logits.argmax(-1).view(rows, k + 1)
    noise = torch.randint(0, 2, (rows, k), generator=torch.Generator().manual_seed(3))
    drafts = torch.where(noise.bool(), best[:, :k], (best[:, :k] + 1) % vocab)
    s = batch(rows, temperature=0.0)
    chain_accepted, chain_tokens = verify_chain(logits, drafts, torch.full((rows,), k), s)
    parents = torch.arange(-1, k - 1).expand(rows, k)
    tree_accepted, tree_tokens, nodes = verify_tree(logits, parents, drafts, s)
    assert torch.equal(chain_accepted, tree_accepted) and torch.equal(chain_tokens, tree_tokens)
    assert torch.equal(nodes, torch.where(torch.arange(k) < tree_accepted[:, None], torch.arange(k), -1))


# --- distributions: chain -------------------------------------------------------------------------------------

def test_first_token_has_the_target_distribution_whatever_the_draft_distribution():
    vocab, rows = 8, 20000
    p_logits = random_logits(vocab, seed=4)
    p = p_logits.softmax(-1)
    gen = torch.Generator().manual_seed(4)
    drafts_from = {
        "one-hot on a likely token": torch.zeros(vocab).scatter(0, p.argmax()[None], 1.0),
        "one-hot on an unlikely token": torch.zeros(vocab).scatter(0, p.argmin()[None], 1.0),
        "random q": torch.rand(vocab, generator=gen).softmax(-1),
        "q == p": p,
    }
    for name, q in drafts_from.items():
        torch.manual_seed(0)
        drafts = torch.multinomial(q, rows, replacement=True, generator=gen)[:, None]
        logits = p_logits.expand(rows * 2, vocab)
        one_hot = q.max() == 1.0
        accepted, tokens = verify_chain(logits, drafts, torch.ones(rows, dtype=torch.long), batch(rows),
                                        draft_probs=None if one_hot else q.expand(rows, 1, vocab))
        assert tv(tokens[:, 0], p) < TV_BOUND, name
        if one_hot:   # deterministic drafts are accepted with the target's probability of the token
            assert abs(accepted.float().mean().item() - p[q.argmax()].item()) < 0.015, name


def test_two_token_joint_is_the_target_joint_when_the_second_target_depends_on_the_first_token():
    vocab, rows, k = 4, 40000, 2
    p1_logits = random_logits(vocab, seed=5)
    p2_logits = random_logits(vocab, vocab, seed=6)     # row x: the target after token x
    p1, p2 = p1_logits.softmax(-1), p2_logits.softmax(-1)
    joint = p1[:, None] * p2                             # [x, y]
    gen = torch.Generator().manual_seed(5)
    q1 = torch.rand(vocab, generator=gen).softmax(-1)
    q2 = torch.rand(vocab, vocab, generator=gen).softmax(-1)
    for deterministic in (True, False):
        torch.manual_seed(1)
        d1 = torch.multinomial(q1, rows, replacement=True, generator=gen)
        d2 = torch.multinomial(q2[d1], 1, generator=gen).squeeze(1)
        # rows of the verify chunk [last, d1, d2]: p1, then p2(. | d1), then the bonus (any: y is the 2nd token)
        logits = torch.stack([p1_logits.expand(rows, vocab), p2_logits[d1], p2_logits[d2]], dim=1)
        draft_probs = None if deterministic else torch.stack([q1.expand(rows, vocab), q2[d1]], dim=1)
        accepted, tokens = verify_chain(logits.reshape(rows * (k + 1), vocab), torch.stack([d1, d2], 1),
                                        torch.full((rows,), k), batch(rows), draft_probs=draft_probs)
        x = tokens[:, 0]
        y = torch.where(accepted >= 1, tokens[:, 1], torch.multinomial(p2[x], 1).squeeze(1))
        assert tv(x * vocab + y, joint) < TV_BOUND, f"deterministic={deterministic}"


def test_top_k_and_top_p_are_applied_to_the_target_before_verification():
    vocab, rows = 8, 20000
    p_logits = random_logits(vocab, seed=7)
    for settings in (dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2), dict(temperature=0.5, top_k=5)):
        s = batch(rows, **settings)
        truncated = target_probs(p_logits.expand(rows, vocab), s)[0]
        assert (truncated == 0).sum() > 0, settings
        torch.manual_seed(2)
        drafts = torch.randint(0, vocab, (rows, 1))       # often outside the kept set: never accepted there
        q = torch.full((rows, 1, vocab), 1.0 / vocab)
        accepted, tokens = verify_chain(p_logits.expand(rows * 2, vocab), drafts, torch.ones(rows, dtype=torch.long),
                                        s, draft_probs=q)
        assert tv(tokens[:, 0], truncated) < TV_BOUND, settings
        assert truncated[tokens[:, 0]].min() > 0, settings


def test_drafts_drawn_from_the_target_itself_are_all_accepted():
    vocab, rows, k = 16, 2000, 3
    logits = random_logits(rows * (k + 1), vocab, seed=8)
    s = batch(rows, temperature=0.8, top_p=0.9)
    p = target_probs(logits, batch(rows * (k + 1), temperature=0.8, top_p=0.9)).view(rows, k + 1, vocab)
    drafts = torch.multinomial(p[:, :k].reshape(-1, vocab), 1).view(rows, k)
    accepted, tokens = verify_chain(logits, drafts, torch.full((rows,), k), s, draft_probs=p[:, :k])
    assert accepted.float().mean().item() == k
    assert torch.equal(tokens[:, :k], drafts)


def test_a_row_with_fewer_drafts_takes_its_bonus_token_after_its_last_draft():
    vocab, k = 10, 4
    logits = torch.full((k + 1, vocab), -30.0)
    for j, t in enumerate([3, 5, 7, 1, 9]):
        logits[j, t] = 30.0                              # position j all but certainly emits t
    accepted, tokens = verify_chain(logits, torch.tensor([[3, 5, -1, -1]]), torch.tensor([2]), batch(1))
    assert accepted.tolist() == [2] and tokens.tolist() == [[3, 5, 7, -1, -1]]


def test_synthetic_acceptance_accepts_each_draft_with_the_given_probability():
    vocab, rows, k = 8, 20000, 2
    logits = random_logits(rows * (k + 1), vocab, seed=9)
    drafts = torch.zeros(rows, k, dtype=torch.long)
    torch.manual_seed(3)
    accepted, tokens = verify_chain(logits, drafts, torch.full((rows,), k), batch(rows, temperature=0.0),
                                    synthetic_acceptance_rate=0.6)
    counts = torch.bincount(accepted, minlength=k + 1).double() / rows
    assert (counts - torch.tensor([0.4, 0.6 * 0.4, 0.36])).abs().max() < 0.015
    best = logits.argmax(-1).view(rows, k + 1)
    assert torch.equal(tokens.gather(1, accepted[:, None]).squeeze(1), best.gather(1, accepted[:, None]).squeeze(1))


# --- distributions: tree --------------------------------------------------------------------------------------

def test_tree_first_two_tokens_have_the_target_joint_with_two_children_at_the_root():
    vocab, rows = 4, 40000
    p1_logits = random_logits(vocab, seed=10)
    p2_logits = random_logits(vocab, vocab, seed=11)
    p1, p2 = p1_logits.softmax(-1), p2_logits.softmax(-1)
    joint = p1[:, None] * p2
    order = p1.argsort(descending=True).tolist()
    #   root ─ n0 ─ n2
    #        └ n1
    parents = torch.tensor([-1, -1, 0]).expand(rows, 3)
    for n0, n1, n2 in ((order[0], order[1], order[0]), (order[3], order[0], order[2]), (order[1], order[1], 0)):
        tokens = torch.tensor([n0, n1, n2]).expand(rows, 3)
        logits = torch.stack([p1_logits, p2_logits[n0], p2_logits[n1], p2_logits[n2]]).repeat(rows, 1)
        torch.manual_seed(4)
        accepted, out, nodes = verify_tree(logits, parents, tokens, batch(rows))
        x = out[:, 0]
        y = torch.where(accepted >= 1, out[:, 1], torch.multinomial(p2[x], 1).squeeze(1))
        assert tv(x, p1) < TV_BOUND, (n0, n1, n2)
        assert tv(x * vocab + y, joint) < TV_BOUND, (n0, n1, n2)
        # the first sibling is accepted with the target's probability of its token
        assert abs((nodes[:, 0] == 0).float().mean().item() - p1[n0].item()) < 0.015
        # the path is consistent: the first accepted node carries the first token; only n0 has a child
        first = nodes[:, 0]
        assert torch.equal(torch.where(first >= 0, tokens.gather(1, first.clamp(min=0)[:, None]).squeeze(1), -1),
                           torch.where(accepted >= 1, x, -1))
        assert ((nodes[:, 1] == 2) == (accepted == 2)).all() and (nodes[:, 0][accepted == 2] == 0).all()


def test_tree_verification_applies_top_k():
    vocab, rows = 8, 20000
    p_logits = random_logits(vocab, seed=12)
    s = batch(rows, top_k=3)
    truncated = target_probs(p_logits.expand(1, vocab), batch(1, top_k=3))[0]
    tokens = torch.tensor([p_logits.argsort()[0], p_logits.argmax()]).expand(rows, 2)   # an excluded, a kept one
    torch.manual_seed(5)
    accepted, out, _ = verify_tree(p_logits.expand(rows * 3, vocab), torch.tensor([-1, -1]).expand(rows, 2),
                                   tokens, s)
    assert tv(out[:, 0], truncated) < TV_BOUND


def test_padded_tree_nodes_are_never_visited():
    vocab = 5
    logits = torch.full((2 * 4, vocab), -30.0)
    logits[:, 2] = 30.0                                  # every position emits 2
    tokens = torch.tensor([[2, -1, -1], [2, 2, -1]])
    parents = torch.tensor([[-1, -1, -1], [-1, 0, -1]])
    accepted, out, nodes = verify_tree(logits, parents, tokens, batch(2))
    assert accepted.tolist() == [1, 2]
    assert out.tolist() == [[2, 2, -1], [2, 2, 2]]
    assert nodes.tolist() == [[0, -1], [0, 1]]


# --- seeds ----------------------------------------------------------------------------------------------------

def test_seeded_rows_verify_identically_on_every_run_whatever_the_global_rng():
    vocab, rows, k = 12, 6, 3
    logits = random_logits(rows * (k + 1), vocab, seed=13)
    drafts = torch.randint(0, vocab, (rows, k), generator=torch.Generator().manual_seed(13))
    tree_tokens = torch.randint(0, vocab, (rows, 5), generator=torch.Generator().manual_seed(14))
    tree_parents = torch.tensor([-1, -1, 0, 0, 1]).expand(rows, 5)
    tree_logits = random_logits(rows * 6, vocab, seed=15)

    def run(seed: int, global_seed: int):
        torch.manual_seed(global_seed)
        s = batch(rows, generators=[torch.Generator().manual_seed(seed + r) for r in range(rows)])
        chain = verify_chain(logits, drafts, torch.full((rows,), k), s)
        s = batch(rows, generators=[torch.Generator().manual_seed(seed + r) for r in range(rows)])
        tree = verify_tree(tree_logits, tree_parents, tree_tokens, s)
        return [t.tolist() for t in (*chain, *tree)]

    assert run(7, 0) == run(7, 1)
    assert any(run(7, 0) != run(s, 0) for s in range(100, 105))


def test_the_all_greedy_shortcut_decides_as_the_general_rule():
    """verify_chain skips the [B, V] distributions when every row is greedy; the general rule on the same rows
    (greedy rows of a batch not marked all-greedy) must give the same acceptances and tokens."""
    from dataclasses import replace

    k, vocab, rows = 3, 30, 64
    logits = random_logits(rows * (k + 1), vocab, seed=5)
    best = logits.argmax(-1).view(rows, k + 1)
    gen = torch.Generator().manual_seed(0)
    wrong = torch.randint(0, vocab, (rows, k), generator=gen)
    drafts = torch.where(torch.rand(rows, k, generator=gen) < 0.6, best[:, :k], wrong)
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    drafts = torch.where(torch.arange(k) < num_drafts[:, None], drafts, -1)
    greedy = batch(rows, temperature=0.0)
    fast = verify_chain(logits, drafts, num_drafts, greedy)
    general = verify_chain(logits, drafts, num_drafts, replace(greedy, all_greedy=False))
    assert fast[0].tolist() == general[0].tolist() and fast[1].tolist() == general[1].tolist()
    assert 0 < fast[0].sum().item() < num_drafts.sum().item()
