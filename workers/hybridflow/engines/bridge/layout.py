"""Layout arithmetic of the 3D-HybridEngine (HybridFlow section 5): which ranks train together, which generate
together, and who exchanges what at the train -> generate transition. Pure functions over integers.

Training layout p-t-d on N = p*t*d ranks, in Megatron's order (TP fastest, then DP, then PP):
    rank = tp + t * (dp + d * pp)
Generation layout p_g-t_g-d_g-d with micro-DP size d_g = (p*t) / (p_g*t_g). Inside one training replica, with
s_t = t/t_g and s_p = p/p_g:
  * HybridFlow: micro-DP groups are *consecutive* TP (and PP) ranks; generation TP/PP groups take ranks at
    strides s_t and s_p. The generation shard of TP rank a is slice a // s_t, which covers training shards
    [j*s_t, (j+1)*s_t) and so contains a's own: one all-gather inside the micro-DP group builds it.

The baselines' groupings (HybridFlow-V, DeepSpeed-Chat) and the analytic communication and memory fractions the
tests and bench/reshard.py compare against are test support: tests/support/reshard_baselines.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Layout:
    p: int
    t: int
    d: int
    p_g: int
    t_g: int

    def __post_init__(self) -> None:
        for name in ("p", "t", "d", "p_g", "t_g"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.t % self.t_g or self.p % self.p_g:
            raise ValueError(f"generation sizes must divide training sizes: t={self.t}, t_g={self.t_g}, "
                             f"p={self.p}, p_g={self.p_g}")

    @property
    def world(self) -> int:
        return self.p * self.t * self.d

    @property
    def s_t(self) -> int:
        return self.t // self.t_g

    @property
    def s_p(self) -> int:
        return self.p // self.p_g

    @property
    def d_g(self) -> int:
        return self.s_t * self.s_p

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of a rank under the training layout."""
        return rank % self.t, (rank // self.t) % self.d, rank // (self.t * self.d)

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.t * (dp + self.d * pp)


def groups(layout: Layout, key: Callable[[int, int, int], object]) -> list[list[int]]:
    """The ranks partitioned by key(tp, dp, pp), each group in rank order, groups sorted."""
    out: dict = {}
    for r in range(layout.world):
        out.setdefault(key(*layout.coords(r)), []).append(r)
    return sorted(out.values())


def train_tp_groups(L: Layout) -> list[list[int]]:
    return groups(L, lambda tp, dp, pp: (dp, pp))


def train_pp_groups(L: Layout) -> list[list[int]]:
    return groups(L, lambda tp, dp, pp: (dp, tp))


def train_dp_groups(L: Layout) -> list[list[int]]:
    return groups(L, lambda tp, dp, pp: (tp, pp))


# --- HybridFlow grouping -----------------------------------------------------------------------------------------

def gen_tp_rank(L: Layout, rank: int) -> int:
    return L.coords(rank)[0] // L.s_t


def gen_pp_rank(L: Layout, rank: int) -> int:
    return L.coords(rank)[2] // L.s_p


def micro_dp_groups(L: Layout) -> list[list[int]]:
    """Ranks that all-gather their training shards into one generation shard (consecutive TP/PP ranks)."""
    return groups(L, lambda tp, dp, pp: (dp, tp // L.s_t, pp // L.s_p))


def gen_tp_groups(L: Layout) -> list[list[int]]:
    """Ranks that generate together: same replica, same micro-DP position, same stage; TP ranks at stride s_t."""
    return groups(L, lambda tp, dp, pp: (dp, tp % L.s_t, pp))


def gen_pp_groups(L: Layout) -> list[list[int]]:
    return groups(L, lambda tp, dp, pp: (dp, tp, pp % L.s_p))


def gen_dp_rank(L: Layout, rank: int) -> int:
    """Index of the generation replica this rank belongs to: d * d_g replicas in all."""
    tp, dp, pp = L.coords(rank)
    return dp * L.d_g + (tp % L.s_t) * L.s_p + (pp % L.s_p)


def train_shard(L: Layout, rank: int) -> tuple[int, int]:
    """(TP slice index out of t, PP stage out of p) a rank trains."""
    tp, _, pp = L.coords(rank)
    return tp, pp


def gen_shard(L: Layout, rank: int) -> tuple[range, range]:
    """Training TP slices and PP stages that make up this rank's generation shard (HybridFlow grouping)."""
    j, k = gen_tp_rank(L, rank), gen_pp_rank(L, rank)
    return range(j * L.s_t, (j + 1) * L.s_t), range(k * L.s_p, (k + 1) * L.s_p)
