"""Static-slot KV cache: one row per running sequence, compacted to the accepted path.

Layout `[layers, rows, Hkv, max_len, Dh]`. The engine keeps its running sequences in rows
0..B-1 (a finished sequence's row is refilled by moving the last row into it), so a step
reads a plain slice `[:B, :, :S]` with no gather.

A verify step writes the root and every tree node at consecutive cache positions after the
sequence's committed length. Only the accepted path survives: `keep_path` copies those
entries down to be contiguous, and the engine's committed length then excludes the rest
(later writes overwrite them). For a chain the accepted path is already contiguous and
nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Reduced-precision attention reads keys in whole blocks of this many (see
# native_engine.attention.whole_key_blocks), so every row holds a multiple of it.
KEY_BLOCK = 16


def whole_key_blocks_of(tokens: int) -> int:
    """`tokens` rounded up to a multiple of KEY_BLOCK."""
    return -(-tokens // KEY_BLOCK) * KEY_BLOCK


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, rows, Hkv, max_len, Dh]
    v: torch.Tensor  # [layers, rows, Hkv, max_len, Dh]

    @classmethod
    def allocate(cls, n_layers: int, rows: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu") -> KVCache:
        max_len = whole_key_blocks_of(max_len)
        shape = (n_layers, rows, n_kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Cache positions per row (tokens): what was asked for, rounded up to KEY_BLOCK."""
        return self.k.shape[3]

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def update(self, layer: int, row_start: int, write_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, Hkv, Dh] at positions write_pos [B, T] of rows row_start.. +B;
        return those rows' keys and values [B, Hkv, key_len, Dh] (views, no copy)."""
        B, T = write_pos.shape
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)  # a bfloat16 model's float32 cache (Transformer.cache_dtype)
        # The engine checks capacity once per step (a check here would sync every layer).
        if B == 1:  # one row: a plain index_copy_, cheaper than advanced indexing at decode
            self.k[layer, row_start].index_copy_(1, write_pos[0], k[0].transpose(0, 1))
            self.v[layer, row_start].index_copy_(1, write_pos[0], v[0].transpose(0, 1))
        else:
            rows = torch.arange(row_start, row_start + B, device=write_pos.device)[:, None].expand(B, T)
            self.k[layer][rows, :, write_pos] = k
            self.v[layer][rows, :, write_pos] = v
        end = row_start + B
        return self.k[layer, row_start:end, :, :key_len], self.v[layer, row_start:end, :, :key_len]

    def write_prompts(self, layer: int, row_start: int, lengths: tuple[int, ...], k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """Write a prefill's k, v [1, N, Hkv, Dh], its prompts' tokens one after another
        (N = sum(lengths)): row row_start + b gets the next lengths[b] at positions 0.."""
        start = 0
        for b, n in enumerate(lengths):
            self.k[layer, row_start + b, :, :n] = k[0, start:start + n].transpose(0, 1)
            self.v[layer, row_start + b, :, :n] = v[0, start:start + n].transpose(0, 1)
            start += n

    def keep_path(self, row: int, start: int, path: list[int]) -> None:
        """Make cache positions start + path[i] contiguous at start + i (all layers).

        path: offsets from `start` of the kept entries, increasing, path[0] = 0 (the root)."""
        if path == list(range(len(path))):
            return  # already contiguous (always so for chains)
        src = torch.tensor([start + p for p in path], device=self.k.device)
        dst = slice(start, start + len(path))
        # Advanced indexing on the right copies first, so overlapping ranges are safe.
        self.k[:, row, :, dst] = self.k[:, row, :, src]
        self.v[:, row, :, dst] = self.v[:, row, :, src]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of row `src` into row `dst` (all layers)."""
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]
