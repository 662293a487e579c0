"""The dispatcher's rules with faked device capabilities and faked builds: pure Python, no device, no kernels."""

import dataclasses

import pytest

from flashgen import dispatch
from flashgen._native import BuildInfo
from flashgen.dispatch import Problem, choose, explain

GPU_HEAD_DIMS = (64, 128, 256)
ALL_FEATURES = frozenset(dispatch.FEATURES)


def _build(generations=("v2",), kinds=("fwd",), dtypes=("fp16", "bf16"), archs=("80", "90a"),
           head_dims=GPU_HEAD_DIMS) -> BuildInfo:
    """A fake build: the CPU backend plus the given GPU instances."""
    instances = {("cpu", kind, dtype, 256) for kind in ("fwd", "bwd") for dtype in ("fp32", "fp16", "bf16")}
    instances |= {(g, kind, dtype, d) for g in generations for kind in kinds for dtype in dtypes for d in head_dims}
    return BuildInfo(frozenset(instances), tuple(archs), "13.0" if archs else "", 256)


CPU_ONLY = _build(generations=(), archs=())
V2_FWD = _build()


def _cuda(capability, dtype="bf16", head_dim=128, features=()) -> Problem:
    return Problem("cuda", capability, dtype, head_dim, frozenset(features))


@pytest.fixture
def v1_v3_implemented(monkeypatch):
    """Pretend v1 and v3 implement the plain forward and causal (their kernels do not exist yet)."""
    for name in ("v1", "v3"):
        spec = dispatch.GENERATIONS[name]
        monkeypatch.setitem(dispatch.GENERATIONS, name,
                            dataclasses.replace(spec, implements=frozenset({"forward", "causal"})))


def test_cpu_tensors_run_on_cpu_with_every_feature():
    choice = choose(Problem("cpu", None, "fp32", 100, ALL_FEATURES), CPU_ONLY)
    assert choice.generation == "cpu"
    assert choice.head_dim_multiple == 1


def test_cpu_tensors_never_go_to_a_gpu_generation():
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        choose(Problem("cpu", None, "bf16", 128), V2_FWD, "v2")


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9)])
def test_ampere_and_ada_run_v2(capability):
    choice = choose(_cuda(capability, features={"causal", "gqa"}), V2_FWD)
    assert choice.generation == "v2"
    assert choice.head_dim_multiple == 8 and choice.alignment_bytes == 16


def test_sm90_runs_v3_forward_and_v2_for_what_v3_lacks():
    built = _build(generations=("v2", "v3"), kinds=("fwd", "bwd"))
    assert choose(_cuda((9, 0)), built).generation == "v3"
    assert choose(_cuda((9, 0), features={"backward", "causal", "gqa"}), built).generation == "v3"
    for features in ({"dropout"}, {"kvcache", "paged_kv", "cache_leftpad"},
                     {"kvcache", "paged_kv", "unaligned_pages"}, {"return_probs"}):
        assert choose(_cuda((9, 0), features=features), built).generation == "v2", features
    # Pages (of multiples of 8 rows) or a left pad, one at a time, run on v3 from DECODE_MAX_SEQLEN_Q rows.
    for features in ({"kvcache", "paged_kv"}, {"kvcache", "cache_leftpad"}, {"varlen", "paged_kv", "gqa"}):
        assert choose(_cuda((9, 0), features=features), built).generation == "v3", features
    assert explain(_cuda((9, 0), features={"kvcache", "paged_kv", "cache_leftpad"}), built)["v3"] == [
        "cache_leftpad with paged_kv together is not implemented in v3 yet"]
    # A KV-cache call with DECODE_MAX_SEQLEN_Q query rows or more (chunked prefill into a dense cache) runs on v3.
    assert choose(_cuda((9, 0), features={"kvcache", "gqa", "causal"}), built).generation == "v3"
    # A decode step (fewer query rows) too: v3's split instance (v3_hopper/v3_api.cu plan_fwd) splits the keys.
    for features in ({"kvcache", "decode"}, {"kvcache", "decode", "paged_kv", "gqa"}):
        assert choose(_cuda((9, 0), features=features), built).generation == "v3", features
    deterministic = explain(_cuda((9, 0), features={"backward", "deterministic"}), built)
    assert deterministic["v3"] == ["deterministic is not implemented in v3 yet"]
    assert choose(_cuda((9, 0), features={"backward", "deterministic"}), built).generation == "v2"


def test_sm90_v3_backward_buckets_from_build_info():
    """The v3 backward compiles head-dim buckets up to 128 (v3_hopper/CMakeLists.txt): a larger head dim's backward
    runs on v2, with the reason."""
    built = BuildInfo(_build(generations=("v2", "v3"), kinds=("fwd", "bwd")).instances -
                      {("v3", "bwd", dt, d) for dt in ("fp16", "bf16") for d in (192, 256)}, ("80", "90a"), "13.0", 256)
    assert choose(_cuda((9, 0), head_dim=96, features={"backward"}), built).generation == "v3"
    assert choose(_cuda((9, 0), head_dim=256, features={"backward"}), built).generation == "v2"
    assert "v3 bwd for bf16 head_dim 256 is not compiled" in explain(
        _cuda((9, 0), head_dim=256, features={"backward"}), built)["v3"][0]


def test_sm90_v3_backward_bucket_span():
    """The v3 backward refuses a head dim that leaves a 64-column chunk of its bucket empty (v3_api.cu): with
    backward buckets 64 and 256 only, d192 and d128 are not v3's (v2 runs them, with the reason), d200 is."""
    built = BuildInfo(_build(generations=("v2", "v3"), kinds=("fwd", "bwd")).instances -
                      {("v3", "bwd", dt, d) for dt in ("fp16", "bf16") for d in (128, 192)}, ("80", "90a"), "13.0", 256)
    assert built.bucket("v3", "bwd", "bf16", 192) is None and built.bucket("v3", "bwd", "bf16", 200) == 256
    assert built.bucket("v3", "fwd", "bf16", 192) == 256  # the forward has no such rule
    assert choose(_cuda((9, 0), head_dim=200, features={"backward"}), built).generation == "v3"
    for head_dim in (128, 192):
        assert choose(_cuda((9, 0), head_dim=head_dim, features={"backward"}), built).generation == "v2"
        reason = explain(_cuda((9, 0), head_dim=head_dim, features={"backward"}), built)["v3"][0]
        assert f"v3 bwd for bf16 head_dim {head_dim} is not compiled" in reason
        assert "less than 64 below it" in reason


def test_sm90_runs_v3_where_it_supports_the_request(v1_v3_implemented):
    built = _build(generations=("v2", "v3"))
    assert choose(_cuda((9, 0), features={"causal"}), built).generation == "v3"
    assert choose(_cuda((9, 0), features={"alibi"}), built).generation == "v2"


def test_sm90_v3_not_compiled_runs_v2(v1_v3_implemented):
    assert choose(_cuda((9, 0)), V2_FWD).generation == "v2"
    reasons = explain(_cuda((9, 0)), V2_FWD)
    assert reasons["v3"] == ["v3 is not compiled into this build (build_info)"]


def test_newer_than_sm90_runs_v2_from_portable_code():
    assert choose(_cuda((10, 0)), V2_FWD).generation == "v2"


def test_newer_than_sm90_without_portable_arch_is_refused():
    with pytest.raises(NotImplementedError, match=r"no arch v2 was compiled for \(build_info: \['90a'\]\)"):
        choose(_cuda((10, 0)), _build(archs=("90a",)))


def test_generation_archs_decide_where_each_generation_runs():
    """A "75;90a" build (the Turing path tested through PTX): v1 has sm_75 code and compute_75 PTX, v2 only sm_90a
    code. On sm_90 both can run (auto takes v2); on sm_86 only v1's PTX runs, and v2's refusal names its archs."""
    built = dataclasses.replace(_build(generations=("v1", "v2"), dtypes=("fp16",), archs=("75", "90a")),
                                generation_archs=(("v1", ("75",)), ("v2", ("90a",))))
    assert built.archs_for("v1") == ("75",) and built.archs_for("v2") == ("90a",)
    assert built.archs_for("cpu") == ("75", "90a")  # not listed: the build's archs
    assert choose(_cuda((9, 0), dtype="fp16"), built).generation == "v2"
    assert choose(_cuda((9, 0), dtype="fp16"), built, "v1").generation == "v1"
    reasons = explain(_cuda((8, 6), dtype="fp16"), built)
    assert reasons["v2"] == ["no arch v2 was compiled for (build_info: ['90a']) runs on sm_86"], reasons["v2"]
    with pytest.raises(NotImplementedError, match="no arch v2 was compiled for"):
        choose(_cuda((8, 6), dtype="fp16"), built, "v2")


def test_v3_is_sm90_only(v1_v3_implemented):
    built = _build(generations=("v2", "v3"))
    with pytest.raises(ValueError, match="sm_90 or older"):
        choose(_cuda((10, 0)), built, "v3")
    with pytest.raises(ValueError, match="sm_90 or newer"):
        choose(_cuda((8, 0)), built, "v3")


def test_sm75_runs_v1_fp16_only(v1_v3_implemented):
    built = _build(generations=("v1", "v2"), dtypes=("fp16", "bf16"), archs=("75", "80"))
    assert choose(_cuda((7, 5), dtype="fp16"), built).generation == "v1"
    with pytest.raises(NotImplementedError, match="v1 needs sm_80 or newer for bf16, the device is sm_75"):
        choose(_cuda((7, 5), dtype="bf16"), built)
    with pytest.raises(ValueError, match="v1 needs sm_80 or newer for bf16"):
        choose(_cuda((7, 5), dtype="bf16"), built, "v1")


_V1_NOT_IMPLEMENTED = {"paged_kv", "cache_leftpad", "unaligned_pages", "short_paged"}  # v1: dense K/V only


@pytest.mark.parametrize("feature", sorted(ALL_FEATURES - _V1_NOT_IMPLEMENTED))
def test_v1_implements_every_feature(feature):
    """v1 (FA1 Alg. 1 / Alg. 4, with block-sparse) runs every feature but paged caches, fp16 from sm_75 and bf16
    from sm_80, when requested by name; auto picks it on sm_75 only."""
    built = _build(generations=("v1", "v2"), kinds=("fwd", "bwd"), archs=("75", "80"))
    for cap, dtype in (((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "fp16")):
        assert explain(_cuda(cap, dtype=dtype, features={feature}), built)["v1"] == [], (cap, dtype, feature)
    assert choose(_cuda((7, 5), dtype="fp16", features={feature}), built).generation == "v1"
    assert choose(_cuda((9, 0), dtype="bf16", features={feature}), built, "v1").generation == "v1"


def test_unaligned_pages_are_v2s():
    """A paged cache whose page size is not a multiple of 8 rows is refused by v3 with its reason (v1 reads no pages
    at all); auto picks v2 for it on sm_90, v3 for a page of 16 rows."""
    built = _build(generations=("v2", "v3"), kinds=("fwd",), archs=("80", "90a"))
    problem = _cuda((9, 0), features={"kvcache", "paged_kv", "unaligned_pages"})
    reasons = explain(problem, built)
    assert any("unaligned_pages" in r and "8-row" in r for r in reasons["v3"]), reasons["v3"]
    assert reasons["v2"] == [] and choose(problem, built).generation == "v2"
    # A generation that reads no pages is refused for the paged cache alone, not for its page size (v3's reason).
    v1 = _build(generations=("v1", "v2"), kinds=("fwd",), archs=("80",))
    for features in ({"kvcache", "paged_kv", "unaligned_pages"}, {"kvcache", "paged_kv", "short_paged"}):
        assert explain(_cuda((8, 0), features=features), v1)["v1"] == ["paged_kv is not implemented in v1 yet"]
    assert choose(_cuda((9, 0), features={"kvcache", "paged_kv"}), built).generation == "v3"


def test_short_paged_calls_prefer_v2_on_sm90():
    """A paged call of few query rows on pages that are not multiples of 128 rows ("short_paged"): every generation
    that reads pages runs it, and auto prefers v2 on sm_90 (v3's tiles of such pages are several TMA boxes, slower
    there) unless it is a decode step; v3 runs it when asked; other archs keep their order."""
    built = _build(generations=("v2", "v3"), kinds=("fwd",), archs=("80", "90a"))
    short = _cuda((9, 0), features={"kvcache", "paged_kv", "short_paged"})
    assert explain(short, built)["v3"] == [] and explain(short, built)["v2"] == []
    choice = choose(short, built)
    assert choice.generation == "v2" and "several TMA boxes" in choice.why
    assert choose(short, built, "v3").generation == "v3"
    assert choose(_cuda((9, 0), features={"kvcache", "paged_kv"}), built).generation == "v3"
    assert choose(_cuda((8, 0), features={"kvcache", "paged_kv", "short_paged"}), built).generation == "v2"
    # A decode step on such pages: v3's split instance (dispatch.py, measured in session 47).
    assert choose(_cuda((9, 0), features={"kvcache", "paged_kv", "short_paged", "decode"}), built).generation == "v3"


def test_sm75_refuses_v2():
    with pytest.raises(ValueError, match="v2 needs sm_80 or newer, the device is sm_75"):
        choose(_cuda((7, 5), dtype="fp16"), V2_FWD, "v2")


def test_older_than_sm75_has_no_generation():
    with pytest.raises(NotImplementedError, match="older than any generation"):
        choose(_cuda((7, 0), dtype="fp16"), V2_FWD)


def test_explicit_version_is_honoured():
    assert choose(Problem("cpu", None, "bf16", 64), CPU_ONLY, "cpu").generation == "cpu"
    assert choose(_cuda((9, 0)), V2_FWD, "v2").why == "requested version='v2'"


def test_unknown_version_is_refused():
    with pytest.raises(ValueError, match="version: expected 'auto' or one of"):
        choose(_cuda((8, 0)), V2_FWD, "v5")


def test_cuda_tensors_are_never_sent_to_the_cpu_backend():
    with pytest.raises(NotImplementedError) as info:
        choose(_cuda((8, 0)), CPU_ONLY)
    message = str(info.value)
    assert "v2 is not compiled into this build (build_info)" in message
    assert "the CPU backend takes CPU tensors" in message
    with pytest.raises(ValueError, match="does not copy them"):
        choose(_cuda((8, 0)), CPU_ONLY, "cpu")


def test_missing_v2_feature_names_feature_and_generation(monkeypatch):
    """v2 implements every feature today: with one taken out of its entry, a call that needs it is refused with a
    message naming the feature and the generation (auto and version="v2" alike)."""
    spec = dispatch.GENERATIONS["v2"]
    monkeypatch.setitem(dispatch.GENERATIONS, "v2", dataclasses.replace(spec, implements=spec.implements - {"alibi"}))
    problem = _cuda((8, 0), features={"causal", "alibi"})
    with pytest.raises(NotImplementedError, match="alibi is not implemented in v2 yet"):
        choose(problem, V2_FWD)
    with pytest.raises(NotImplementedError, match="alibi is not implemented in v2 yet"):
        choose(problem, V2_FWD, "v2")


@pytest.mark.parametrize("feature", sorted(ALL_FEATURES - {"backward"}))
def test_v2_forward_features(feature):
    assert explain(_cuda((8, 0), features={feature}), V2_FWD)["v2"] == []


@pytest.mark.parametrize("feature", sorted(ALL_FEATURES - {"backward", "kvcache", "decode"}))
def test_v2_backward_features(feature):
    assert explain(_cuda((9, 0), features={feature, "backward"}), _build(kinds=("fwd", "bwd")))["v2"] == []


def test_generation_without_kernels_says_so(monkeypatch):
    spec = dispatch.GENERATIONS["v3"]
    monkeypatch.setitem(dispatch.GENERATIONS, "v3", dataclasses.replace(spec, implements=frozenset()))
    reasons = explain(_cuda((9, 0)), _build(generations=("v2", "v3")))
    assert reasons["v3"] == ["v3 forward is not implemented yet"]
    assert reasons["v1"] == ["v1 is not compiled into this build (build_info)"]


def test_fp32_on_gpu_is_refused_with_reasons():
    with pytest.raises(NotImplementedError, match="v2 supports dtypes"):
        choose(_cuda((8, 0), dtype="fp32"), V2_FWD)


def test_head_dim_buckets_come_from_build_info():
    assert choose(_cuda((8, 0), head_dim=40), V2_FWD).generation == "v2"  # padded to 40, runs in bucket 64
    narrow = _build(head_dims=(64,))
    with pytest.raises(NotImplementedError, match=r"head_dim 96 is not compiled into this build \(build_info has head"):
        choose(_cuda((8, 0), head_dim=96), narrow)


def test_backward_needs_compiled_backward():
    with pytest.raises(NotImplementedError, match="v2 bwd for bf16 head_dim 128 is not compiled"):
        choose(_cuda((8, 0), features={"backward"}), V2_FWD)
    assert choose(_cuda((8, 0), features={"backward"}), _build(kinds=("fwd", "bwd"))).generation == "v2"


def test_explain_lists_every_generation():
    reasons = explain(Problem("cpu", None, "fp16", 64, frozenset({"dropout"})), CPU_ONLY)
    assert set(reasons) == set(dispatch.GENERATIONS)
    assert reasons["cpu"] == []
    assert all(reasons[g] for g in ("v1", "v2", "v3"))


def test_problem_rejects_unknown_features():
    with pytest.raises(ValueError, match="Problem.features"):
        Problem("cpu", None, "fp32", 64, frozenset({"telepathy"}))


def test_memoized_choice_follows_the_table_and_the_build(monkeypatch):
    """choose_for (the call path's memoized choose) gives what choose gives, forgets its choices when GENERATIONS
    changes, keys on the build, and does not memoize refusals."""
    built = _build(generations=("v2", "v3"))
    args = ("cuda", (9, 0), "bf16", 128, frozenset({"causal"}))
    spec = dispatch.GENERATIONS["v3"]
    monkeypatch.setitem(dispatch.GENERATIONS, "v3", dataclasses.replace(spec, implements=frozenset()))
    assert dispatch.choose_for(*args, built) == choose(_cuda((9, 0), features={"causal"}), built)
    assert dispatch.choose_for(*args, built).generation == "v2"
    monkeypatch.setitem(dispatch.GENERATIONS, "v3", dataclasses.replace(spec, implements=frozenset({"forward",
                                                                                                  "causal"})))
    assert dispatch.choose_for(*args, built).generation == "v3", "a changed table must not reuse a memoized choice"
    assert dispatch.choose_for(*args, V2_FWD).generation == "v2", "the build is part of the key"
    v2 = dispatch.GENERATIONS["v2"]
    monkeypatch.setitem(dispatch.GENERATIONS, "v2", dataclasses.replace(v2, implements=v2.implements - {"block_sparse"}))
    for _ in range(2):
        with pytest.raises(NotImplementedError):
            dispatch.choose_for("cuda", (9, 0), "bf16", 128, frozenset({"block_sparse"}), V2_FWD, "v2")


def test_v2_runs_block_sparse():
    """v2's block-sparse kernels passed tests/test_gpu_block_sparse.py on the H200 (session 12): dispatch lists
    block_sparse for v2, and auto sends block-sparse calls to v2 where it is compiled (v3 has none)."""
    assert "block_sparse" in dispatch.GENERATIONS["v2"].implements
    assert "block_sparse" not in dispatch.GENERATIONS["v3"].implements
    built = _build(generations=("v1", "v2", "v3"), kinds=("fwd", "bwd"), archs=("80", "90a"))
    for capability in ((9, 0), (8, 0)):
        problem = _cuda(capability, features=("block_sparse", "backward"))
        assert choose(problem, built).generation == "v2"


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 9), (10, 0)])
def test_block_sparse_falls_back_to_v1_on_newer_gpus(capability, monkeypatch):
    """A block-sparse call on sm_80+ runs v1 when no earlier generation in auto's order implements it (it raised
    NotImplementedError on the H200 while v1 could run it; v2 implements it now, so this drops it from v2's entry);
    dense calls still prefer v2 / v3."""
    spec = dispatch.GENERATIONS["v2"]
    monkeypatch.setitem(dispatch.GENERATIONS, "v2",
                        dataclasses.replace(spec, implements=spec.implements - {"block_sparse"}))
    built = _build(generations=("v1", "v2", "v3"), kinds=("fwd", "bwd"), archs=("80", "90a"))
    sparse = _cuda(capability, features=("block_sparse", "backward", "causal"))
    assert choose(sparse, built).generation == "v1"
    assert choose(_cuda(capability, features=("causal",)), built).generation in ("v2", "v3")


def test_features_not_implemented_together():
    """v1 returns probabilities for dense inputs only: varlen with return_probs is refused on v1 with a reason that
    names both (before any launch; it came from the native layer before), and auto picks v2 for it."""
    built = _build(generations=("v1", "v2"), kinds=("fwd", "bwd"), archs=("80",))
    both = _cuda((8, 0), features=("varlen", "return_probs"))
    reasons = dispatch.explain(both, built)
    assert reasons["v1"] == ["return_probs with varlen together is not implemented in v1 yet"]
    assert reasons["v2"] == []
    assert choose(both, built).generation == "v2"
    for alone in ("varlen", "return_probs"):
        assert dispatch.explain(_cuda((8, 0), features=(alone,)), built)["v1"] == []
    with pytest.raises(NotImplementedError, match="return_probs with varlen"):
        dispatch.choose_for("cuda", (8, 0), "bf16", 64, frozenset({"varlen", "return_probs"}), built, "v1")


def test_value_bucket_reads_the_forward_instances_with_their_own_value_head_dim():
    """BuildInfo.value_bucket: a forward instance listed with kind VALUE_KIND + V's bucket runs q / k in the bucket
    the plain forward gives them and V in the smallest listed V bucket >= head_dim_v; nothing else does (the API then
    pads V). The CPU backend's "fwd_v256" takes any pair."""
    from flashgen._native import VALUE_KIND
    buckets = (64, 128, 192, 256)
    built = BuildInfo(_build(generations=("v3",), kinds=("fwd",), head_dims=buckets).instances |
                      {("v3", VALUE_KIND + "128", "bf16", 192), ("cpu", VALUE_KIND + "256", "bf16", 256)},
                      ("90a",), "13.0", 256)
    assert built.value_bucket("v3", "bf16", 192, 128) == 128
    assert built.value_bucket("v3", "bf16", 136, 72) == 128, "q / k in the 192 bucket, V in the 128 one"
    assert built.value_bucket("v3", "bf16", 192, 136) is None, "no V bucket >= 136 beside 192"
    assert built.value_bucket("v3", "bf16", 128, 64) is None, "no pair beside the 128 bucket"
    assert built.value_bucket("v3", "fp16", 192, 128) is None, "listed for bf16 only"
    assert built.value_bucket("v3", "bf16", 300, 128) is None, "no forward bucket for q / k"
    assert built.value_bucket("cpu", "bf16", 24, 200) == 256
    assert built.head_dims("v3", "fwd", "bf16") == buckets, "the pair is not a plain forward bucket"


def test_value_bucket_of_the_backward():
    """BuildInfo.value_bucket(kind="bwd"): a backward instance listed with kind BWD_VALUE_KIND + V's bucket beside q /
    k's backward bucket; v3's backward loads every 64-column chunk of a bucket (BUCKET_SPAN), of V's too, so V of 64
    in the 128 bucket is padded instead. Forward and backward pairs are read apart."""
    from flashgen._native import BWD_VALUE_KIND, VALUE_KIND
    built = BuildInfo(_build(generations=("v3",), kinds=("fwd", "bwd"), head_dims=(64, 128, 192, 256)).instances |
                      {("v3", BWD_VALUE_KIND + "128", "bf16", 192), ("v3", VALUE_KIND + "64", "bf16", 192)},
                      ("90a",), "13.0", 256)
    assert built.value_bucket("v3", "bf16", 192, 128, kind="bwd") == 128
    assert built.value_bucket("v3", "bf16", 136, 72, kind="bwd") == 128, "every chunk of both buckets has columns"
    assert built.value_bucket("v3", "bf16", 192, 64, kind="bwd") is None, "V's 128 bucket with an empty chunk"
    assert built.value_bucket("v3", "bf16", 128, 64, kind="bwd") is None, "no pair beside the 128 bucket"
    assert built.value_bucket("v3", "bf16", 192, 128) is None, "the forward has only the 64 pair"
    assert built.value_bucket("v3", "bf16", 192, 64) == 64
    assert built.value_bucket("v3", "bf16", 192, 64, kind="bwd") is None, "the backward has no 64 pair"
