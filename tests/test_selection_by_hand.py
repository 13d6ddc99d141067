"""The blend's selection pieces by hand: the question's reading of each key, the score that weighs deviation by it,
the chunk-start rows, a prompt's ratio and the selection rules, each on a case worked out here."""

from __future__ import annotations

import math

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.errors import KvragError


def test_suffix_attention_is_the_mean_softmax_weight_per_key():
    """Against a plain loop: each suffix query head's softmax over the chunk keys of its KV head, averaged."""
    from kvrag.blend.selection import suffix_attention

    g = torch.Generator().manual_seed(3)
    s, h_kv, group, hd, c = 5, 3, 3, 16, 40
    q = torch.randn(s, h_kv * group, hd, generator=g)
    k = torch.randn(c, h_kv, hd, generator=g)
    want = torch.zeros(c)
    for row in range(s):
        for head in range(h_kv * group):
            want += torch.softmax(k[:, head // group] @ q[row, head] / hd ** 0.5, dim=0)
    want /= s * h_kv * group
    torch.testing.assert_close(suffix_attention(q, k, group), want)


def test_selection_score_weighs_deviation_by_relative_reading():
    """Hand-computed: read [1, 3] has mean 2, so weight 4 scales the deviations by 1 + 4 * 0.5 = 3 and
    1 + 4 * 1.5 = 7; a token the question reads more overtakes one that deviates more. Weight 0: deviation."""
    from kvrag.blend.selection import weigh_by_reading

    deviation, read = torch.tensor([2.0, 1.0]), torch.tensor([1.0, 3.0])
    torch.testing.assert_close(weigh_by_reading(deviation, read, 4.0), torch.tensor([6.0, 7.0]))
    torch.testing.assert_close(weigh_by_reading(deviation, read, 0.0), deviation)
    torch.testing.assert_close(weigh_by_reading(deviation, 10 * read, 4.0), torch.tensor([6.0, 7.0]))  # scale-free
    with pytest.raises(KvragError, match="attention-weight"):
        BlendConfig(attention_weight=-1)


def test_chunk_start_mask_and_prompt_ratio_by_hand():
    from kvrag.blend.fusion import keep_count, prompt_ratio
    from kvrag.blend.selection import chunk_start_mask

    starts = torch.tensor([0, 5, 9])  # chunks of 5, 4 and 3 tokens
    rows = torch.arange(2, 12)  # the first chunk's first two rows are not ranked (exact)
    assert chunk_start_mask(rows, starts, 2).tolist() == [False, False, False, True, True, False, False, True,
                                                          True, False]
    score = torch.tensor([64.0, 16.0, 4.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # norms 8, 4, 2, 1, 1: total 16
    assert prompt_ratio(score, 20, BlendConfig(ratio=0.1)) == 0.1  # no mass: the configured ratio
    assert prompt_ratio(score[:0], 20, BlendConfig(ratio=0.1, deviation_mass=0.9)) == 0.1  # nothing ranked
    massed = BlendConfig(ratio=0.1, deviation_mass=0.9, max_ratio=0.5)
    assert prompt_ratio(score, 20, massed) == 4 / 20  # norms 8+4+2+1 = 15 >= 0.9 x 16
    assert prompt_ratio(score, 20, BlendConfig(ratio=0.1, deviation_mass=0.9, max_ratio=0.15)) == 0.15  # capped
    assert prompt_ratio(score, 20, BlendConfig(ratio=0.1, deviation_mass=0.4)) == 0.1  # 8 >= 0.4 x 16: the floor
    forced = score.clone()
    forced[5] = math.inf  # a forced row counts for nothing in the mass
    assert prompt_ratio(forced, 20, massed) == 4 / 20
    # the gradual schedule (1.5x the share, then the share) scaled to the prompt's ratio
    assert keep_count(10, 0.15, 20, massed, 0.2) == 6 and keep_count(10, 0.1, 20, massed, 0.2) == 4
    assert keep_count(3, 0.1, 20, massed, 0.2) == 3  # never more than were ranked


def test_selection_rules_by_hand():
    """The rule registry: `reading` ranks by the question's attention alone, `cacheblend` by deviation x reading;
    forced chunk starts score inf under any rule; an unknown rule is one line naming the known ones."""
    from kvrag.blend.selection import Check, score

    hd = 4
    keys = torch.zeros(3, 1, hd)
    keys[2, 0, 0] = 4.0  # the question's query points at row 2
    q = torch.zeros(1, 1, hd)
    q[0, 0, 0] = 4.0
    fresh_v = torch.zeros(3, 1, hd)
    fresh_v[0] = 10.0  # row 0 deviates most
    check = Check((keys, fresh_v), (keys, torch.zeros(3, 1, hd)), q, keys, torch.arange(3), torch.tensor([0, 1]), 1)
    assert int(score(check, BlendConfig(selection="reading")).argmax()) == 2
    assert int(score(check, BlendConfig(selection="cacheblend")).argmax()) == 0
    assert int(score(check, BlendConfig(selection="cacheblend", attention_weight=0)).argmax()) == 0
    forced = score(check, BlendConfig(selection="reading", chunk_start_rows=1))
    assert forced[1] == float("inf")  # row 1 starts the second chunk
    with pytest.raises(KvragError, match="cacheblend, reading"):
        BlendConfig(selection="nope")
