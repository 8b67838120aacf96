"""Where each shard of a unit lies, so a rank's OS shard is in its G shard is in its P shard.

Layout of one padded unit of U elements (DESIGN.md 3a): P shard j is the j-th contiguous
1/s_P of the unit; G shard g is piece g div s_P of P shard g mod s_P, cut in s_G/s_P pieces;
OS shard o is piece o div s_G of G shard o mod s_G, cut in s_OS/s_G pieces. Rank r holds
P shard r mod s_P, G shard r mod s_G, OS shard r mod s_OS, hpZ shard r mod h_z (contiguous).

Two collectives deliver chunks in member order rather than layout order, and need a permuted
copy (see [Note: permuted copies]):
- the gradient reduction: member k of the G-group receives chunk pos(k) of the input, with
  pos(k) = k for a reduce-scatter and pos(m*s0 + l) = l*s1 + m for the qgZ two-hop all-to-all
  (l: in-node index, m: node index); the staged input puts G shard k at chunk pos(k);
- the update all-gather: member j of P_update (OS shard i_P + j*s_P) delivers chunk j, which
  lies at ``update_positions()[j]`` (in OS-shard units) inside the P shard.

[Note: permuted copies] Both are one ``index_select`` / ``index_copy_`` over chunk rows, done
only when the permutation is not the identity (1 < s_P < s_G, qgZ, s_P < s_G < s_OS).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitLayout:
    """Shard offsets of one unit of `size` padded elements under factors (s_P, s_G, s_OS)."""

    size: int
    s_p: int
    s_g: int
    s_os: int
    hpz: int = 1

    def __post_init__(self) -> None:
        assert self.size % self.s_os == 0 and self.s_g % self.s_p == 0
        assert self.s_os % self.s_g == 0 and self.size % max(self.hpz, 1) == 0

    @property
    def p_len(self) -> int:
        return self.size // self.s_p

    @property
    def g_len(self) -> int:
        return self.size // self.s_g

    @property
    def os_len(self) -> int:
        return self.size // self.s_os

    @property
    def hpz_len(self) -> int:
        return self.size // self.hpz

    def p_off(self, j: int) -> int:
        return j * self.p_len

    def g_off(self, g: int) -> int:
        return self.p_off(g % self.s_p) + (g // self.s_p) * self.g_len

    def os_off(self, o: int) -> int:
        return self.g_off(o % self.s_g) + (o // self.s_g) * self.os_len

    # ----- permutations ---------------------------------------------------------------------
    def grad_source_chunks(self, s0: int = 0, s1: int = 1) -> list[int] | None:
        """For the gradient reduction input: chunk c of the staged copy = unit chunk out[c]
        (chunks of U/s_G). `s0, s1`: the qgZ mesh (0: plain reduce-scatter). None = identity."""
        n = self.s_g
        src = [0] * n
        for k in range(n):
            pos = k if not s0 else (k % s0) * s1 + k // s0
            src[pos] = self.g_off(k) // self.g_len
        return None if src == list(range(n)) else src

    def update_positions(self, i_p: int) -> list[int] | None:
        """Chunk j of the update all-gather lies at chunk out[j] (of U/s_OS) of P shard i_p."""
        q = self.s_os // self.s_p
        pos = [(self.os_off(i_p + j * self.s_p) - self.p_off(i_p)) // self.os_len
               for j in range(q)]
        return None if pos == list(range(q)) else pos
