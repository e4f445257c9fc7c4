"""Low-bit KV cache with one scale per (token, head): FP8 (e4m3) or int8 codes.

Flags: ``--kv-cache-dtype int8_per_token_head`` or ``fp8_per_token_head`` (vLLM's names;
the second is also ``--kv-cache-dtype fp8_e4m3 --kv-scale per-token``).

SGLang's FP8 KV stores ``float8_e4m3fn`` with one scale per tensor (1.0 unless calibrated), so
a token whose K or V exceeds +-448 saturates and small ones lose precision. Here every
(token, head) row of K and of V gets its own scale, computed when it is written:

| per token, per layer | bytes (SmolLM2: 3 KV heads x 64) | what |
|---|---|---|
| K and V codes | 2 x H x D x 1 | ``float8_e4m3fn``, or ``int8`` (symmetric, round to nearest) |
| K and V scales | 2 x H x 2 | ``bfloat16``: amax(row) / 448 (e4m3) or / 127 (int8) |

The two code formats cost the same bytes; int8's error is uniform over a row (step amax/127)
where e4m3 keeps 3 mantissa bits at every magnitude, and on this model int8 loses less
(``experiments/kv_schemes.py``: KL 0.0028 against e4m3's 0.0115 over 2,048 GSM8K tokens).

A 16-bit window (``--kv-full-precision-tokens S,W``, :mod:`sgl_reason.runtime.kv_window`)
keeps each request's first S and last W tokens also in 16 bits, and attention reads those
instead of their codes (KIVI's residual window): the pool owns it (``kv_window``) and writes
it in ``set_kv_buffer``; the CPU attention reads it.

Reads never dequantize the pool: ``get_key_buffer`` returns a :class:`PerTokenFP8View` and
attention gathers the rows it needs (``view[idx]`` or ``view.rows(slots)``), dequantizing only
those; decode takes them as codes and scales (``view.coded_rows(slots)``) and applies the scale
to its scores and probabilities, one multiply per row instead of one per element. Pool sizing
counts the scale bytes (the cell-size hook below), so a memory budget buys the true number of
tokens.

Supported: the torch_native attention backend (CPU), with the radix cache, forks and the
plugin's CPU attention; and SGLang's Triton backend (GPU) through the kernel in
:mod:`sgl_reason.runtime.triton_fp8`, which dequantizes inside the kernel (tested under the
Triton interpreter on CPU, not yet run on a GPU), with CUDA graphs off. Anything else fails at
launch with the list of what is supported.

Scales travel with codes wherever the pool's rows move: slot moves (``move_kv_cache``) and
SGLang's host copy of a request's KV (``get_cpu_copy``/``load_cpu_copy``). The scales are kept
beside SGLang's KV-quantization interface (``KVCacheQuantMethodBase``), not in it: in 0.5.23 that
interface serves packed FP4 recipes, and its copy paths move ``k_buffer``/``v_buffer`` only. So
the paths that would move codes without scales are refused at launch: hierarchical cache (its
host pool), PD disaggregation (its KV transfer registers the code buffers only), and a per-phase
attention backend other than the one above. (The host copy's only user in 0.5.23 is the PD
decode side's retraction backup, so inside the supported set nothing reaches it yet.)
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from sgl_reason.runtime import kv_window
from sgl_reason.runtime.flags import export_to, has_flag, wrap_server_args

logger = logging.getLogger(__name__)

ENV = "SGL_REASON_KV_SCALE"
CODES_ENV = "SGL_REASON_KV_CODES"
MODES = ("per-tensor", "per-token")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
CODE_DTYPES = {"e4m3": FP8, "int8": torch.int8}
# --kv-cache-dtype values this plugin adds (vLLM's names): the codes of each
KV_CACHE_DTYPES = {"fp8_per_token_head": "e4m3", "int8_per_token_head": "int8"}
SCALE_DTYPE = torch.bfloat16
SUPPORTED = {"kv_cache_dtype": ("fp8_e4m3",), "attention_backend": ("torch_native", "triton")}


def mode() -> str:
    """``per-tensor`` (stock SGLang), ``per-token``, or, for benchmarks only, an emulation of
    per-tensor scaling inside this pool: ``fixed:S`` (every row scaled by S; S=1.0 is SGLang's
    uncalibrated default) or ``layers:PATH`` (per-layer K/V scales from a calibration JSON)."""
    return os.environ.get(ENV, "per-tensor")


def codes() -> str:
    """The pool's code format: ``e4m3`` (default) or ``int8``."""
    name = os.environ.get(CODES_ENV, "e4m3")
    if name not in CODE_DTYPES:
        raise ValueError(f"{CODES_ENV}={name!r}: use one of {', '.join(CODE_DTYPES)}")
    return name


def uses_pool() -> bool:
    m = mode()
    return m == "per-token" or m.startswith(("fixed:", "layers:"))


def _fixed_scales(num_layers: int) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) per layer for the per-tensor emulations, None for per-token."""
    m = mode()
    if m.startswith("fixed:"):
        value = float(m.split(":", 1)[1])
        return [(value, value)] * num_layers
    if m.startswith("layers:"):
        import json
        from pathlib import Path

        table = json.loads(Path(m.split(":", 1)[1]).read_text())
        return [(float(k), float(v)) for k, v in zip(table["k"], table["v"])]
    return None


# -- the numbers ------------------------------------------------------------------------------

def quantize(x: torch.Tensor, fixed: float | None = None, code: str = "e4m3"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D], scale [...] in SCALE_DTYPE), one scale per row (or the
    ``fixed`` scale for every row: per-tensor scaling, values beyond the largest code x scale
    saturate). ``code``: ``e4m3`` (float8_e4m3fn codes) or ``int8`` (rounded to nearest)."""
    if code not in CODE_DTYPES:
        raise ValueError(f"unknown KV code {code!r}: use one of {', '.join(CODE_DTYPES)}")
    top = INT8_MAX if code == "int8" else FP8_MAX
    if fixed is None:
        amax = x.abs().amax(dim=-1).float()
        scale = (amax / top).clamp(min=1e-12).to(SCALE_DTYPE)
    else:
        scale = torch.full(x.shape[:-1], fixed, dtype=SCALE_DTYPE, device=x.device)
    y = (x.float() / scale.float().unsqueeze(-1)).clamp_(-top, top)
    if code == "int8":
        return y.round_().to(torch.int8), scale
    return y.to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """codes [..., D] x scale [...] -> ``dtype``: :func:`code_values` times the scale."""
    values, factor = code_values(q)
    row_scale = scale.float() if factor == 1.0 else scale.float().mul(factor)
    return values.mul_(row_scale.unsqueeze(-1)).to(dtype)


def code_values(q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """codes [..., D] -> (fp32 values, factor): value x factor x the row's scale is the element.
    int8 codes: their value, factor 1. fp8 codes: without PyTorch's fp8 cast (scalar on CPU: a
    decode step's KV reads take 3.6x as long through it, ``benchmarks/fp8_dequant.py``).

    The e4m3 bits ``s eeee mmm`` (bias 7) are moved into an fp16 ``s eeeee mmmmmmmmmm``
    (bias 15): the sign from bit 7 to bit 15, exponent and mantissa from bits 6..0 to 13..7, so
    the fp16 reads the fp8 value x 2^-8, subnormals included (both formats scale them alike).
    ``(b + (b & 0x80)) << 7`` does both moves in int16; the 2^8 goes into the scale. Exact for
    every code but NaN (0x7f, 0xff: read as +-480), which :func:`quantize` never writes."""
    if q.dtype == torch.int8:
        return q.float(), 1.0
    bits = q.view(torch.uint8).to(torch.int16)
    bits.add_(bits & 0x80).bitwise_left_shift_(7)
    return bits.view(torch.float16).float(), 256.0


class PerTokenFP8View:
    """What ``get_key_buffer`` returns: indexing dequantizes only the selected token rows.
    ``window``: the pool's 16-bit window (``kv_window.KVWindow``) or None, and which of its
    stores (``window_store()``) holds this layer's K or V."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                 window=None, store: tuple[str, int] | None = None):
        self.data, self.scale, self.dtype = data, scale, dtype  # data: fp8 or int8 [N, H, D]
        self.window, self._store = window, store

    def window_store(self) -> torch.Tensor:
        kind, layer = self._store
        return getattr(self.window, kind)[layer]

    @property
    def shape(self):
        return self.data.shape

    @property
    def device(self):
        return self.data.device

    def __getitem__(self, idx) -> torch.Tensor:
        return dequantize(self.data[idx], self.scale[idx], torch.float32)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return dequantize(torch.index_select(self.data, 0, slots),
                          torch.index_select(self.scale, 0, slots), torch.float32)

    def coded_rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``slots`` undequantized: (code values [n, H, D] fp32, scales [n, H] fp32),
        value x scale the element, for attention that applies the scale to its scores and
        probabilities instead (``cpu_attention._partial``)."""
        values, factor = code_values(torch.index_select(self.data, 0, slots))
        row_scale = torch.index_select(self.scale, 0, slots).float()
        return values, row_scale if factor == 1.0 else row_scale.mul_(factor)

    def __repr__(self):
        return f"PerTokenFP8View(tokens={self.data.shape[0]}, heads={self.data.shape[1]})"


def scale_bytes_per_token(num_layers: int, kv_heads: int) -> int:
    return num_layers * 2 * kv_heads * torch._utils._element_size(SCALE_DTYPE)


# -- the pool ---------------------------------------------------------------------------------

def pool_class():
    """The pool subclass (built on first use: it derives from SGLang's MHATokenToKVPool)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

    class PerTokenFP8KVPool(MHATokenToKVPool):
        """MHATokenToKVPool whose K/V rows carry their own bf16 scale."""

        def _create_buffers(self):
            super()._create_buffers()
            self._fixed = _fixed_scales(self.layer_num)
            self.codes = codes()
            self._code_dtype = CODE_DTYPES[self.codes]
            logger.info("sgl-reason per-token KV pool: %s codes, one %s scale per token and "
                        "head", self.codes, str(SCALE_DTYPE).removeprefix("torch."))
            rows = self.k_buffer[0].shape[0]
            self.token_k_scale = [torch.ones(rows, self.head_num, dtype=SCALE_DTYPE, device=self.device)
                                  for _ in range(self.layer_num)]
            self.token_v_scale = [torch.ones(rows, self.head_num, dtype=SCALE_DTYPE, device=self.device)
                                  for _ in range(self.layer_num)]
            sink, window = kv_window.parse(os.environ.get(kv_window.ENV, "0,0"))
            self.kv_window = None
            if sink or window:
                self.kv_window = kv_window.KVWindow(sink, window, self.layer_num, self.head_num,
                                                    self.head_dim, self.v_head_dim, self.device)

        def _clear_buffers(self):
            super()._clear_buffers()
            del self.token_k_scale, self.token_v_scale

        def get_kv_size_bytes(self):
            k, v = super().get_kv_size_bytes()
            scales = sum(t.numel() * t.element_size() for t in self.token_k_scale)
            return k + scales, v + scales

        def _get_key_buffer(self, layer_id: int):
            i = layer_id - self.start_layer
            return PerTokenFP8View(self.k_buffer[i].view(self._code_dtype), self.token_k_scale[i],
                                   self.dtype, self.kv_window, ("k", i))

        def _get_value_buffer(self, layer_id: int):
            i = layer_id - self.start_layer
            return PerTokenFP8View(self.v_buffer[i].view(self._code_dtype), self.token_v_scale[i],
                                   self.dtype, self.kv_window, ("v", i))

        def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                          layer_id_override=None, dcp_kv_mask=None):
            if dcp_kv_mask is not None:
                raise RuntimeError("per-token FP8 KV does not support decode context parallelism")
            loc, _, _ = unwrap_write_loc(loc_info)
            layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
            i = layer_id - self.start_layer
            fixed = self._fixed[i] if self._fixed is not None else (None, None)
            qk, sk = quantize(cache_k.view(-1, self.head_num, self.head_dim), fixed[0], self.codes)
            qv, sv = quantize(cache_v.view(-1, self.head_num, self.v_head_dim), fixed[1],
                              self.codes)
            self.k_buffer[i][loc] = qk.view(self.store_dtype)
            self.v_buffer[i][loc] = qv.view(self.store_dtype)
            self.token_k_scale[i][loc] = sk
            self.token_v_scale[i][loc] = sv
            if self.kv_window is not None:
                self.kv_window.write(i, loc, cache_k.view(-1, self.head_num, self.head_dim),
                                     cache_v.view(-1, self.head_num, self.v_head_dim))

        def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
            """SGLang's host copy of a request's KV (codes), with each chunk's scales."""
            copy = super().get_cpu_copy(indices, mamba_indices, req_pool_index)
            chunk = self.cpu_offloading_chunk_size
            for layer, chunks in enumerate(copy):
                for i, pair in enumerate(chunks):
                    rows = indices[i * chunk:(i + 1) * chunk]
                    pair.extend([self.token_k_scale[layer][rows].cpu(),
                                 self.token_v_scale[layer][rows].cpu()])
            return copy

        def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None,
                          req_pool_index=None):
            super().load_cpu_copy(kv_cache_cpu, indices, mamba_indices, req_pool_index)
            chunk = self.cpu_offloading_chunk_size
            for layer, chunks in enumerate(kv_cache_cpu):
                for i, pair in enumerate(chunks):
                    if len(pair) != 4:
                        raise RuntimeError("a host copy of per-token KV without its scales: "
                                           "it was not made by this pool's get_cpu_copy")
                    rows = indices[i * chunk:(i + 1) * chunk]
                    self.token_k_scale[layer][rows] = pair[2].to(self.device)
                    self.token_v_scale[layer][rows] = pair[3].to(self.device)

        def move_kv_cache(self, tgt_loc, src_loc):
            super().move_kv_cache(tgt_loc, src_loc)
            for ks, vs in zip(self.token_k_scale, self.token_v_scale):
                ks[tgt_loc] = ks[src_loc]
                vs[tgt_loc] = vs[src_loc]

    return PerTokenFP8KVPool


# -- wiring into SGLang (plugin) --------------------------------------------------------------

def add_cli_flag(parser: argparse.ArgumentParser) -> None:
    if has_flag(parser, "--kv-scale"):
        return
    parser.add_argument(
        "--kv-scale", choices=MODES, default=None, action=export_to(ENV),
        help="(sgl-reason) FP8 KV scale granularity with --kv-cache-dtype fp8_e4m3: per-tensor "
             "(stock SGLang) or per-token (one scale per token and head)",
    )
    parser.add_argument(
        "--kv-full-precision-tokens", default=None, metavar="S,W",
        action=export_to(kv_window.ENV),
        help="(sgl-reason) with a per-token KV pool, keep a 16-bit copy of each request's first "
             "S and last W tokens, which attention reads instead of their codes (default "
             "0,0: off). One copy per running request: --max-running-requests defaults to "
             f"{kv_window.DEFAULT_LANES} with it",
    )
    for action in parser._actions:  # the plugin's code formats join SGLang's KV dtypes
        if "--kv-cache-dtype" in action.option_strings and action.choices is not None:
            action.choices = [*action.choices, *KV_CACHE_DTYPES]
            action.help = (f"{action.help or ''} (sgl-reason adds "
                           f"{', '.join(KV_CACHE_DTYPES)}: one scale per token and head)")


def prepare(server_args) -> None:
    """``--kv-cache-dtype int8_per_token_head`` / ``fp8_per_token_head``: the per-token pool with
    those codes, stored in SGLang's 1-byte KV layout (its ``fp8_e4m3``), exported to the
    scheduler through the environment like ``--kv-scale``."""
    name = server_args.kv_cache_dtype
    if name in KV_CACHE_DTYPES:
        if os.environ.get(ENV) == "per-tensor":
            raise ValueError(f"--kv-cache-dtype {name} has one scale per token and head; drop "
                             "--kv-scale per-tensor (or use --kv-cache-dtype fp8_e4m3 for "
                             "SGLang's per-tensor FP8)")
        os.environ[ENV] = "per-token"
        os.environ[CODES_ENV] = KV_CACHE_DTYPES[name]
        server_args.kv_cache_dtype = "fp8_e4m3"
    text = os.environ.get(kv_window.ENV)
    if (text is not None and any(kv_window.parse(text))
            and getattr(server_args, "max_running_requests", None) is None):
        server_args.max_running_requests = kv_window.DEFAULT_LANES  # one window lane each


def _window_obstacles(server_args) -> list[str]:
    """What keeps this launch from reading a 16-bit window (empty: nothing)."""
    from sgl_reason.runtime import cpu_attention

    problems = []
    backend = getattr(server_args, "attention_backend", None)
    if backend != "torch_native":
        problems.append(f"--attention-backend {backend} (the window is "
                        "read by sgl-reason's CPU attention for torch_native)")
    if not cpu_attention.enabled():
        problems.append(f"{cpu_attention.ENV}=0 (stock attention would read codes only)")
    if getattr(server_args, "speculative_algorithm", None):
        problems.append(f"--speculative-algorithm {server_args.speculative_algorithm}")
    return problems


def validate_window(server_args) -> None:
    """``--kv-full-precision-tokens``: only over the per-token pool, read by the CPU attention."""
    text = os.environ.get(kv_window.ENV)
    if text is None or not any(kv_window.parse(text)):
        return
    problems = _window_obstacles(server_args)
    if not uses_pool():
        problems.insert(0, "a 16-bit KV pool (add --kv-cache-dtype int8_per_token_head or "
                           "fp8_per_token_head)")
    if problems:
        raise ValueError(f"--kv-full-precision-tokens {text} does not support "
                         f"{'; '.join(problems)}. Supported: a per-token pool "
                         "(--kv-cache-dtype int8_per_token_head) with --attention-backend "
                         "torch_native (CPU); elsewhere drop the flag.")


def validate(server_args) -> None:
    """Refuse unsupported combinations at launch, listing what is supported."""
    validate_window(server_args)
    if not uses_pool():
        return
    problems = []
    if server_args.kv_cache_dtype not in SUPPORTED["kv_cache_dtype"]:
        problems.append(f"--kv-cache-dtype {server_args.kv_cache_dtype}")
    backend = server_args.attention_backend
    if backend not in SUPPORTED["attention_backend"]:
        problems.append(f"--attention-backend {backend}")
    for phase in ("prefill", "decode"):  # a per-phase backend overrides --attention-backend
        chosen = getattr(server_args, f"{phase}_attention_backend", None)
        if chosen not in (None, backend):
            problems.append(f"--{phase}-attention-backend {chosen}")
    if backend == "triton" and not server_args.disable_cuda_graph:
        problems.append("CUDA graphs (add --disable-cuda-graph)")
    # paths that copy the pool's K/V buffers without the scales beside them
    if getattr(server_args, "enable_hierarchical_cache", False):
        problems.append("--enable-hierarchical-cache (its host pool copies codes, not scales)")
    if getattr(server_args, "disaggregation_mode", "null") not in ("null", None):
        problems.append(f"--disaggregation-mode {server_args.disaggregation_mode} (its KV "
                        "transfer moves codes, not scales)")
    if problems:
        raise ValueError(
            f"--kv-scale per-token does not support {', '.join(problems)}. Supported: "
            "--kv-cache-dtype fp8_e4m3 with --attention-backend torch_native (CPU) or "
            "--attention-backend triton --disable-cuda-graph (GPU), on one server without "
            "hierarchical cache; elsewhere use --kv-scale per-tensor."
        )


def install() -> None:
    """Patch ServerArgs (flag, validation), the pool class and the pool's cell size."""
    from sglang.srt.server_args import ServerArgs

    if getattr(ServerArgs, "_sgl_reason_fp8", False):
        return
    wrap_server_args("fp8", add_cli_flag, validate, prepare)

    from sglang.srt.mem_cache import kv_cache_configurator as kc
    from sglang.srt.model_executor import pool_configurator as pc

    stock_resolve = kc.KVCacheConfigurator._resolve_kv_pool_class

    def resolve(self, *, kind, default):
        if kind == "mha" and uses_pool():
            return pool_class()
        return stock_resolve(self, kind=kind, default=default)

    kc.KVCacheConfigurator._resolve_kv_pool_class = resolve

    # Stock SGLang serves FP8 KV on CPU only through AMX kernels (intel_amx backend) and refuses
    # it otherwise. The per-token pool needs neither: its quant method is its own (none of
    # SGLang's), and the AMX gate is lifted for the one check that applies it, nowhere else.
    stock_quant = kc.KVCacheConfigurator._build_mha_quant_method
    stock_configure = kc.KVCacheConfigurator.configure

    def build_quant(self, *, num_layers):
        if uses_pool():
            return None
        return stock_quant(self, num_layers=num_layers)

    def configure(self, *, pre_model_load_memory):
        if not uses_pool() or self.kv_cache_dtype != FP8:
            return stock_configure(self, pre_model_load_memory=pre_model_load_memory)
        amx, backends = kc.cpu_has_amx_support, kc.attention_backends
        first = [True]

        def gate_backends():
            if first[0]:  # the AMX gate's own call, the first in configure()
                first[0] = False
                return ("intel_amx",)
            return backends()

        kc.cpu_has_amx_support, kc.attention_backends = (lambda: True), gate_backends
        try:
            return stock_configure(self, pre_model_load_memory=pre_model_load_memory)
        finally:
            kc.cpu_has_amx_support, kc.attention_backends = amx, backends

    kc.KVCacheConfigurator._build_mha_quant_method = build_quant
    kc.KVCacheConfigurator.configure = configure

    stock_cell = pc.DefaultPoolConfigurator._compute_cell_size

    def cell_size(self, kvc, num_layers):
        size = stock_cell(self, kvc, num_layers)
        if uses_pool() and not kvc.use_mla_backend:
            heads = kvc.model_config.get_num_kv_heads(pc.get_parallel().attn_tp_size)
            size += scale_bytes_per_token(num_layers, heads)
        return size

    pc.DefaultPoolConfigurator._compute_cell_size = cell_size
