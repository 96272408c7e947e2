"""Layout arithmetic of the 3D-HybridEngine (HybridFlow section 5): which ranks train together, which generate
together, and who exchanges what at the train -> generate transition. Pure functions over integers.

Training layout p-t-d on N = p*t*d ranks, in Megatron's order (TP fastest, then DP, then PP):
    rank = tp + t * (dp + d * pp)
Generation layout p_g-t_g-d_g-d with micro-DP size d_g = (p*t) / (p_g*t_g). Inside one training replica, with
s_t = t/t_g and s_p = p/p_g:
  * HybridFlow: micro-DP groups are *consecutive* TP (and PP) ranks; generation TP/PP groups take ranks at
    strides s_t and s_p. The generation shard of TP rank a is slice a // s_t, which covers training shards
    [j*s_t, (j+1)*s_t) and so contains a's own: one all-gather inside the micro-DP group builds it.
  * HybridFlow-V (naive): generation TP groups are consecutive ranks, so a rank's generation slice is a % t_g,
    which in general does not contain its training shard: the whole model-parallel group must be all-gathered.
  * DeepSpeed-Chat: training is ZeRO-3 over all N ranks; generation all-gathers every parameter everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


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


def _groups(layout: Layout, key) -> list[list[int]]:
    out: dict = {}
    for r in range(layout.world):
        out.setdefault(key(*layout.coords(r)), []).append(r)
    return sorted(out.values())


def train_tp_groups(L: Layout) -> list[list[int]]:
    return _groups(L, lambda tp, dp, pp: (dp, pp))


def train_pp_groups(L: Layout) -> list[list[int]]:
    return _groups(L, lambda tp, dp, pp: (dp, tp))


def train_dp_groups(L: Layout) -> list[list[int]]:
    return _groups(L, lambda tp, dp, pp: (tp, pp))


def model_parallel_groups(L: Layout) -> list[list[int]]:
    """All TP x PP ranks of one training replica (what HybridFlow-V gathers over)."""
    return _groups(L, lambda tp, dp, pp: (dp,))


# --- HybridFlow grouping -----------------------------------------------------------------------------------------

def gen_tp_rank(L: Layout, rank: int) -> int:
    return L.coords(rank)[0] // L.s_t


def gen_pp_rank(L: Layout, rank: int) -> int:
    return L.coords(rank)[2] // L.s_p


def micro_dp_groups(L: Layout) -> list[list[int]]:
    """Ranks that all-gather their training shards into one generation shard (consecutive TP/PP ranks)."""
    return _groups(L, lambda tp, dp, pp: (dp, tp // L.s_t, pp // L.s_p))


def gen_tp_groups(L: Layout) -> list[list[int]]:
    """Ranks that generate together: same replica, same micro-DP position, same stage; TP ranks at stride s_t."""
    return _groups(L, lambda tp, dp, pp: (dp, tp % L.s_t, pp))


def gen_pp_groups(L: Layout) -> list[list[int]]:
    return _groups(L, lambda tp, dp, pp: (dp, tp, pp % L.s_p))


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


# --- HybridFlow-V (naive) grouping -------------------------------------------------------------------------------

def naive_gen_shard(L: Layout, rank: int) -> tuple[range, range]:
    """Under consecutive generation TP/PP groups, rank a generates with slice a % t_g (and stage pp % p_g)."""
    tp, _, pp = L.coords(rank)
    j, k = tp % L.t_g, pp % L.p_g
    return range(j * L.s_t, (j + 1) * L.s_t), range(k * L.s_p, (k + 1) * L.s_p)


def naive_gen_tp_groups(L: Layout) -> list[list[int]]:
    return _groups(L, lambda tp, dp, pp: (dp, pp, tp // L.t_g))


# --- Communication and memory, as fractions of the model size M --------------------------------------------------

def comm_fraction(L: Layout, scheme: str) -> Fraction:
    """Bytes each device receives at the transition, as a fraction of M (the paper's Table 2)."""
    tp_ = L.t * L.p
    if scheme == "hybridflow":
        return Fraction(tp_ - L.t_g * L.p_g, L.t_g * L.p_g * tp_)
    if scheme == "hybridflow-v":
        return Fraction(tp_ - 1, tp_)
    if scheme == "deepspeed-chat":
        return Fraction(L.world - 1, L.world)
    raise ValueError(f"unknown scheme {scheme!r}")


def peak_memory_fraction(L: Layout, scheme: str) -> Fraction:
    """Generation-time parameter memory per device, as a fraction of M."""
    if scheme == "hybridflow":
        return Fraction(1, L.t_g * L.p_g)
    if scheme in ("hybridflow-v", "deepspeed-chat"):
        return Fraction(1)
    raise ValueError(f"unknown scheme {scheme!r}")


def redundancy_free(L: Layout) -> bool:
    """Every rank's training shard lies inside its generation shard (HybridFlow's zero-redundancy property)."""
    for r in range(L.world):
        tps, pps = gen_shard(L, r)
        tp, pp = train_shard(L, r)
        if tp not in tps or pp not in pps:
            return False
    return True
