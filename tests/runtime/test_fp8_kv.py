"""Per-token FP8 KV: quantization error bounds, pool accounting, launch validation, a real server."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from sgl_reason.runtime import fp8_kv

# e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 per element, plus the bf16
# rounding of the scale (<= 2^-8), relative to the row's absolute maximum.
REL_BOUND = 2 ** -4 + 2 ** -8


def _roundtrip_error(x):
    q, s = fp8_kv.quantize(x)
    back = fp8_kv.dequantize(q, s)
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return ((back - x.float()).abs() / amax.clamp(min=1e-12)).max().item()


def test_roundtrip_random():
    x = torch.randn(512, 3, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert _roundtrip_error(x) <= REL_BOUND


def test_roundtrip_outlier_heavy():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 3, 64, generator=g) * 0.01
    x[::7, :, 5] = 3000.0  # a few huge channels (outliers) in some tokens
    x[1::5] *= 1e-4  # and tiny tokens next to them
    err = _roundtrip_error(x.bfloat16())
    assert err <= REL_BOUND
    # one scale for the whole tensor (per-tensor) loses the tiny tokens entirely
    q, s = fp8_kv.quantize(x, fixed=float(x.abs().max()) / fp8_kv.FP8_MAX)
    tiny = fp8_kv.dequantize(q, s)[1::5]
    assert (tiny == 0).float().mean() > 0.5


def test_dequantize_matches_the_fp8_cast_on_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_kv.FP8).view(256, 1, 1)
    finite = ~codes.float().isnan().view(256)
    assert int(finite.sum()) == 254  # all but the two NaNs
    for scale in (1.0, 3.5e-3, 17.0):
        s = torch.full((256, 1), scale).to(fp8_kv.SCALE_DTYPE)
        cast = codes.float() * s.float().unsqueeze(-1)  # PyTorch's own (slow) fp8 cast
        ours = fp8_kv.dequantize(codes, s)
        assert torch.equal(ours[finite], cast[finite])
        assert fp8_kv.dequantize(codes, s, torch.bfloat16).dtype == torch.bfloat16


# int8: half a step of amax/127, the step widened by the bf16 rounding of the scale (<= 2^-8),
# or, where that rounding shrank the scale, the clamp at 127 steps (<= 2^-8 of amax)
INT8_BOUND = 1 / 254 + 2 ** -8


def test_int8_roundtrip_is_within_half_a_step_and_trades_against_e4m3_by_outliers():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 3, 64, generator=g).bfloat16()

    def mse(code):
        q, s = fp8_kv.quantize(x, code=code)
        return ((fp8_kv.dequantize(q, s) - x.float()) ** 2).mean()

    assert mse("int8") < mse("e4m3") / 2  # gaussian rows: int8's 127 steps beat 3 mantissa bits
    x[:, :, 3] *= 40  # an outlier channel: int8's uniform step coarsens the rest of the row
    assert mse("int8") > mse("e4m3")
    q, s = fp8_kv.quantize(x, code="int8")
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    assert ((fp8_kv.dequantize(q, s) - x.float()).abs() / amax).max().item() <= INT8_BOUND
    with pytest.raises(ValueError, match="unknown KV code 'int4': use one of e4m3, int8"):
        fp8_kv.quantize(x, code="int4")


def test_per_tensor_scale_one_saturates():
    x = torch.tensor([[1000.0, -900.0, 0.5]])
    q, s = fp8_kv.quantize(x, fixed=1.0)
    assert fp8_kv.dequantize(q, s).tolist()[0][:2] == [448.0, -448.0]


def test_view_dequantizes_only_the_rows_asked_for():
    q, s = fp8_kv.quantize(torch.randn(100, 3, 8))
    view = fp8_kv.PerTokenFP8View(q, s, torch.bfloat16)
    rows = view.rows(torch.tensor([3, 7]))
    assert rows.shape == (2, 3, 8)
    torch.testing.assert_close(rows, view[torch.tensor([3, 7])])


def test_pool_capacity_accounts_for_scales(monkeypatch):
    monkeypatch.setenv(fp8_kv.ENV, "per-token")
    pool_cls = fp8_kv.pool_class()
    size, layers, heads, dim = 64, 4, 3, 64
    pool = pool_cls(size=size, page_size=1, dtype=torch.float8_e4m3fn, head_num=heads,
                    head_dim=dim, layer_num=layers, device="cpu", enable_memory_saver=False)
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    rows = pool.k_buffer[0].shape[0]
    assert k_bytes + v_bytes == rows * (2 * layers * heads * dim + fp8_kv.scale_bytes_per_token(layers, heads))
    per_token = 2 * layers * heads * dim + fp8_kv.scale_bytes_per_token(layers, heads)
    assert per_token / (2 * layers * heads * dim * 2) <= 0.53
    # writes quantize per (token, head); reads dequantize
    layer = SimpleNamespace(layer_id=1)
    k = torch.randn(5, heads, dim)
    pool.set_kv_buffer(layer, torch.arange(10, 15), k, k * 2)
    got = pool.get_key_buffer(1)[torch.arange(10, 15)]
    assert ((got - k).abs() <= REL_BOUND * k.abs().amax(dim=-1, keepdim=True)).all()


def test_int8_pool_stores_int8_codes_in_the_one_byte_layout(monkeypatch):
    monkeypatch.setenv(fp8_kv.ENV, "per-token")
    monkeypatch.setenv(fp8_kv.CODES_ENV, "int8")
    heads, dim = 3, 64
    pool = fp8_kv.pool_class()(size=32, page_size=1, dtype=torch.float8_e4m3fn, head_num=heads,
                               head_dim=dim, layer_num=2, device="cpu",
                               enable_memory_saver=False)
    k = torch.randn(4, heads, dim)
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), torch.arange(4, 8), k, -k)
    keys, values = pool.get_key_buffer(0), pool.get_value_buffer(0)
    assert keys.data.dtype == torch.int8 and pool.k_buffer[0].element_size() == 1
    amax = k.abs().amax(dim=-1, keepdim=True)
    assert ((keys.rows(torch.arange(4, 8)) - k).abs() <= INT8_BOUND * amax).all()
    assert ((values[torch.arange(4, 8)] + k).abs() <= INT8_BOUND * amax).all()
    monkeypatch.setenv(fp8_kv.CODES_ENV, "int4")
    with pytest.raises(ValueError, match="SGL_REASON_KV_CODES='int4': use one of e4m3, int8"):
        fp8_kv.codes()


def test_vllm_style_kv_dtypes_select_the_per_token_pool_and_its_codes(monkeypatch):
    # prepare() writes the environment (for the scheduler it spawns): give it a copy, so that
    # no server this session starts later inherits a per-token pool
    env = {k: v for k, v in os.environ.items() if k not in (fp8_kv.ENV, fp8_kv.CODES_ENV)}
    monkeypatch.setattr(os, "environ", env)
    args = SimpleNamespace(kv_cache_dtype="int8_per_token_head")
    fp8_kv.prepare(args)
    assert args.kv_cache_dtype == "fp8_e4m3"  # SGLang's one-byte layout
    assert fp8_kv.uses_pool() and fp8_kv.codes() == "int8"
    args = SimpleNamespace(kv_cache_dtype="bfloat16")
    fp8_kv.prepare(args)
    assert args.kv_cache_dtype == "bfloat16"
    monkeypatch.setenv(fp8_kv.ENV, "per-tensor")
    with pytest.raises(ValueError, match="drop --kv-scale per-tensor"):
        fp8_kv.prepare(SimpleNamespace(kv_cache_dtype="fp8_per_token_head"))


def test_unsupported_combination_lists_what_is_supported(monkeypatch):
    monkeypatch.setenv(fp8_kv.ENV, "per-token")
    args = SimpleNamespace(kv_cache_dtype="auto", attention_backend="flashinfer", disable_cuda_graph=False)
    with pytest.raises(ValueError, match="Supported: --kv-cache-dtype fp8_e4m3 with --attention-backend torch_native"):
        fp8_kv.validate(args)
    with pytest.raises(ValueError, match=r"does not support CUDA graphs \(add --disable-cuda-graph\)"):
        fp8_kv.validate(SimpleNamespace(kv_cache_dtype="fp8_e4m3", attention_backend="triton",
                                        disable_cuda_graph=False))
    fp8_kv.validate(SimpleNamespace(kv_cache_dtype="fp8_e4m3", attention_backend="torch_native",
                                    disable_cuda_graph=False))
    fp8_kv.validate(SimpleNamespace(kv_cache_dtype="fp8_e4m3", attention_backend="triton",
                                    disable_cuda_graph=True))


@pytest.mark.parametrize("flag, value, message", [
    ("enable_hierarchical_cache", True, "--enable-hierarchical-cache"),
    ("disaggregation_mode", "decode", "--disaggregation-mode decode"),
    ("disaggregation_mode", "prefill", "--disaggregation-mode prefill"),
    ("decode_attention_backend", "flashinfer", "--decode-attention-backend flashinfer"),
    ("prefill_attention_backend", "fa3", "--prefill-attention-backend fa3"),
])
def test_paths_that_would_move_codes_without_scales_are_refused(monkeypatch, flag, value,
                                                                 message):
    monkeypatch.setenv(fp8_kv.ENV, "per-token")
    args = SimpleNamespace(kv_cache_dtype="fp8_e4m3", attention_backend="torch_native",
                           disable_cuda_graph=False, **{flag: value})
    with pytest.raises(ValueError, match=f"does not support {message}.*Supported:"):
        fp8_kv.validate(args)
    # the same phase backend as --attention-backend is no override
    fp8_kv.validate(SimpleNamespace(kv_cache_dtype="fp8_e4m3", attention_backend="torch_native",
                                    disable_cuda_graph=False,
                                    decode_attention_backend="torch_native"))


@pytest.mark.parametrize("code", ["e4m3", "int8"])
def test_the_host_copy_of_a_requests_kv_carries_its_scales(monkeypatch, code):
    monkeypatch.setenv(fp8_kv.ENV, "per-token")
    monkeypatch.setenv(fp8_kv.CODES_ENV, code)
    heads, dim, layers = 2, 16, 2
    pool = fp8_kv.pool_class()(size=64, page_size=1, dtype=torch.float8_e4m3fn, head_num=heads,
                               head_dim=dim, layer_num=layers, device="cpu",
                               enable_memory_saver=False)
    pool.cpu_offloading_chunk_size = 3  # several chunks per layer
    rows = torch.tensor([5, 9, 10, 11, 30, 31, 40])
    k = torch.randn(len(rows), heads, dim) * torch.logspace(-2, 2, len(rows))[:, None, None]
    for layer in range(layers):
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), rows, k * (layer + 1), -k)
    before = [(pool.get_key_buffer(i).rows(rows), pool.get_value_buffer(i).rows(rows))
              for i in range(layers)]
    copy = pool.get_cpu_copy(rows)
    for layer in range(layers):  # the slots are reused by another request meanwhile
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), rows, torch.randn_like(k),
                           torch.randn_like(k))
    pool.load_cpu_copy(copy, rows)
    for i, (key, value) in enumerate(before):
        assert torch.equal(pool.get_key_buffer(i).rows(rows), key)
        assert torch.equal(pool.get_value_buffer(i).rows(rows), value)
    with pytest.raises(RuntimeError, match="without its scales"):
        pool.load_cpu_copy([[pair[:2] for pair in chunks] for chunks in copy], rows)


@pytest.mark.server
def test_per_token_server_generates_and_refuses_bad_flags():
    from sgl_reason import EmbeddedRuntime, ServerStartError

    with EmbeddedRuntime(extra_args=["--kv-cache-dtype", "fp8_e4m3", "--kv-scale", "per-token"]) as rt:
        out = rt.generate("<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n",
                          max_new_tokens=24, temperature=0, ignore_eos=True)
        assert out["meta_info"]["completion_tokens"] == 24 and out["text"].strip()
        # forks share the quantized prefix through the radix cache
        prefix = "Shared context about numbers. " * 40
        first = rt.generate(prefix + "A", max_new_tokens=2)
        second = rt.generate(prefix + "B", max_new_tokens=2)
        assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 2
    with pytest.raises(ServerStartError, match="--kv-scale per-token does not support --kv-cache-dtype auto"):
        EmbeddedRuntime(extra_args=["--kv-scale", "per-token"]).start()


@pytest.mark.server
@pytest.mark.extended
def test_int8_per_token_head_server_reads_what_16_bit_reads(fresh_cache):
    """``--kv-cache-dtype int8_per_token_head`` (vLLM's name) builds the int8 pool, and its
    next-token distributions along a teacher-forced text stay close to the 16-bit server's;
    with a 16-bit window of the last 64 tokens (``--kv-full-precision-tokens 0,64``) closer."""
    from sgl_reason import EmbeddedRuntime
    from sgl_reason.bench.fp8_kv import gsm8k_text, kl_and_top1, top_logprobs

    text = gsm8k_text(40, 300)
    int8 = ["--kv-cache-dtype", "int8_per_token_head"]
    with EmbeddedRuntime(extra_args=int8) as rt:
        started = rt.server.tail(10_000)  # the start-up log, the pool's line in it
        ours = top_logprobs(rt, text)
    with EmbeddedRuntime(extra_args=[*int8, "--kv-full-precision-tokens", "0,64"]) as rt:
        windowed = top_logprobs(rt, text)
        greedy = rt.generate("<|im_start|>user\nCount to ten.<|im_end|>\n<|im_start|>assistant\n",
                             max_new_tokens=80, temperature=0, ignore_eos=True)  # past the ring
        log = rt.server.tail(20_000)
    assert "per-token KV pool: int8 codes" in started, started[-3000:]
    assert "KV window: first 0 and last 64 tokens" in log, log[-3000:]
    assert greedy["meta_info"]["completion_tokens"] == 80 and greedy["text"].strip()
    ref = top_logprobs(fresh_cache, text)  # the session's 16-bit server, its cache emptied
    kl, top1 = kl_and_top1(ref, ours)
    assert len(ref) > 250 and kl < 0.02 and top1 > 0.9, (kl, top1)
    kl_window, _ = kl_and_top1(ref, windowed)
    assert kl_window < 0.8 * kl, (kl_window, kl)


def test_the_fp32_reference_holds_exactly_the_16_bit_weights(tmp_path):
    """``bench fp8-kv`` measures 16-bit KV's own error against an upcast folder: it must hold the
    same weights (so a difference is arithmetic and KV precision only) and the same tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_reason.bench.fp8_kv import upcast
    from sgl_reason.model import default_model_path

    source = default_model_path()
    out = upcast(source, tmp_path / "fp32")
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).state_dict()
    wide = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert {v.dtype for v in wide.values()} == {torch.float32}
    assert ref.keys() == wide.keys()
    assert all(torch.equal(wide[k].bfloat16(), v) and torch.equal(wide[k], v.float())
               for k, v in ref.items())
    text = "Question: 12 * 7 = ?"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == \
        AutoTokenizer.from_pretrained(source)(text).input_ids
