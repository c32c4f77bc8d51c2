"""Per-row LoRA adapters (RowAdapters): each row of one batched forward equals that row run alone
through plain diffusers/PEFT with ``set_adapters(names, adapter_weights=scales)``.

The adapters are random (B clearly non-zero), written with the pipeline's ``save_lora_weights`` and
read back with ``load_lora_weights``, so they go through diffusers' real loader."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("peft")

from diffusers import DiffusionPipeline  # noqa: E402
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

from diffserve.executor.lora.row_adapters import METHODS, RowAdapters  # noqa: E402
from diffserve.builders.embedded import embedded_path  # noqa: E402

ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
CLIP_ATTN = ["q_proj", "k_proj", "v_proj", "out_proj"]


@dataclass(frozen=True)
class Spec:
    """One random adapter: its denoiser targets and, optionally, text-encoder targets."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    text_targets: tuple[str, ...] = ()
    rslora: bool = False


# "b" has rank 16 and alpha != r (saved with its config, so the scale is 0.5), "c" targets only
# some layers (on tiny-sd with rsLoRA's alpha / sqrt(r)); the extra targets cover conv layers and
# Linears fed 2-D (batch, features) inputs.
ADAPTERS = {
    "tiny-sd": {"a": Spec(4, 4, (*ATTN,), (*CLIP_ATTN,)),
                "b": Spec(16, 8, (*ATTN, "ff.net.0.proj", "conv1", "conv2", "proj_in", "time_emb_proj")),
                "c": Spec(8, 8, ("to_k", "to_v", "conv_shortcut"), rslora=True)},
    "tiny-sdxl": {"a": Spec(4, 4, (*ATTN,)),
                  "b": Spec(16, 8, (*ATTN, "proj_in", "ff.net.2", "conv1", "linear_1")),
                  "c": Spec(8, 8, ("to_k", "to_v"))},
    "tiny-sd3": {"a": Spec(4, 4, (*ATTN,)),
                 "b": Spec(16, 8, (*ATTN, "add_q_proj", "to_add_out", "ff.net.2", "pos_embed.proj")),
                 "c": Spec(8, 8, ("to_k", "to_v"))},
    "tiny-flux": {"a": Spec(4, 4, (*ATTN,)),
                  "b": Spec(16, 8, (*ATTN, "add_k_proj", "proj_mlp", "norm1.linear", "context_embedder")),
                  "c": Spec(8, 8, ("to_k", "to_v"))},
}
# Tests that need one model only: the tiny-sd setup, shared with the parametrized tests.
ONLY_SD = pytest.mark.parametrize("setup", ["tiny-sd"], indirect=True)
STACKS = [(), [("a", 1.0)], [("b", 1.0)], [("a", 0.5)], [("a", 0.7), ("b", 0.3)],
          [("b", -0.5), ("c", 1.2)]]
# Each adapter's rows contiguous (they are taken as a view, not gathered), scales differing.
RUNS = [[("a", 1.0)], [("a", 0.5)], [("a", 1.0), ("b", 0.5)], [("b", 1.0)], (), [("c", 2.0)]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: a second intra-op thread only adds contention (and minutes on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def denoiser_of(pipe):
    return getattr(pipe, "unet", None) or pipe.transformer


def write_adapters(model: str, directory) -> dict[str, str]:
    """Random adapters for ``model``, each saved as a diffusers LoRA file: {name: folder}."""
    scratch = DiffusionPipeline.from_pretrained(embedded_path(model))
    denoiser, key = denoiser_of(scratch), "unet" if hasattr(scratch, "unet") else "transformer"
    paths = {}
    for seed, (name, spec) in enumerate(ADAPTERS[model].items()):
        torch.manual_seed(seed)
        # init_lora_weights=False keeps the layers' random init: B is not zero.
        config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                            use_rslora=spec.rslora, init_lora_weights=False)
        denoiser.add_adapter(config, adapter_name=name)
        layers = {f"{key}_lora_layers": get_peft_model_state_dict(denoiser, adapter_name=name),
                  f"{key}_lora_adapter_metadata": config.to_dict()}
        if spec.text_targets:
            text_config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, init_lora_weights=False,
                                     target_modules=list(spec.text_targets))
            scratch.text_encoder.add_adapter(text_config, adapter_name=name)
            layers["text_encoder_lora_layers"] = get_peft_model_state_dict(scratch.text_encoder,
                                                                           adapter_name=name)
            # Metadata for one part only makes the loader build the other's config from nothing.
            layers["text_encoder_lora_adapter_metadata"] = text_config.to_dict()
        paths[name] = str(directory / name)
        type(scratch).save_lora_weights(paths[name], **layers)
    return paths


def loaded(model: str, paths: dict[str, str]):
    pipe = DiffusionPipeline.from_pretrained(embedded_path(model))
    for name, path in paths.items():
        pipe.load_lora_weights(path, adapter_name=name)
    return pipe


def denoiser_inputs(model: str, denoiser, n: int, seed: int = 0) -> tuple[dict, dict]:
    """(batched inputs, with dim 0 = rows; inputs shared by all rows) for one denoiser call."""
    g = torch.Generator().manual_seed(seed)
    c = denoiser.config

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    t = torch.linspace(10, 900, n)
    if model in ("tiny-sd", "tiny-sdxl"):
        rows = dict(sample=randn(n, 4, 8, 8), timestep=t,
                    encoder_hidden_states=randn(n, 7, c.cross_attention_dim))
        if model == "tiny-sdxl":
            text = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
            rows["added_cond_kwargs"] = dict(text_embeds=randn(n, text), time_ids=randn(n, 6))
        return rows, {}
    if model == "tiny-sd3":
        return dict(hidden_states=randn(n, c.in_channels, 8, 8), timestep=t,
                    encoder_hidden_states=randn(n, 5, c.joint_attention_dim),
                    pooled_projections=randn(n, c.pooled_projection_dim)), {}
    rows = dict(hidden_states=randn(n, 16, c.in_channels), timestep=t / 1000,
                encoder_hidden_states=randn(n, 5, c.joint_attention_dim),
                pooled_projections=randn(n, c.pooled_projection_dim))
    return rows, dict(img_ids=randn(16, 3), txt_ids=torch.zeros(5, 3))


def row(inputs, i: int):
    if isinstance(inputs, dict):
        return {k: row(v, i) for k, v in inputs.items()}
    return inputs[i:i + 1]


def set_stack(pipe, stack) -> None:
    """The plain diffusers way to run one row with ``stack``."""
    if stack:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in stack], adapter_weights=[s for _, s in stack])
    else:
        pipe.disable_lora()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item(), f"{what}: max error {err}"


@dataclass
class Setup:
    model: str
    pipe: object          # RowAdapters attached to its denoiser and text encoder
    ref: object           # plain diffusers/PEFT, the reference
    adapters: RowAdapters

    def batched(self, stacks, inputs, shared, method="loop"):
        self.adapters.method = method
        with torch.no_grad(), self.adapters.rows(stacks):
            return denoiser_of(self.pipe)(**inputs, **shared, return_dict=False)[0]

    def solo(self, stack, inputs, shared):
        set_stack(self.ref, stack)
        with torch.no_grad():
            return denoiser_of(self.ref)(**inputs, **shared, return_dict=False)[0]


@pytest.fixture(scope="module", params=list(ADAPTERS))
def setup(request, tmp_path_factory):
    model = request.param
    paths = write_adapters(model, tmp_path_factory.mktemp(model))
    pipe, ref = loaded(model, paths), loaded(model, paths)
    yield Setup(model, pipe, ref, RowAdapters(denoiser_of(pipe), pipe.text_encoder))


@pytest.mark.parametrize("stacks", [STACKS, RUNS], ids=["scattered", "runs"])
@pytest.mark.parametrize("method", METHODS)
def test_rows_equal_each_row_alone(setup, method, stacks):
    inputs, shared = denoiser_inputs(setup.model, denoiser_of(setup.pipe), len(stacks))
    out = setup.batched(stacks, inputs, shared, method)
    base = setup.solo((), row(inputs, 0), shared)
    for i, stack in enumerate(stacks):
        expected = setup.solo(stack, row(inputs, i), shared)
        assert_close(out[i:i + 1], expected, f"row {i} {stack}")
        if stack:  # the adapters visibly change the output
            change = (expected - setup.solo((), row(inputs, i), shared)).abs().max()
            assert change > 1e-2 * base.abs().max(), f"row {i} {stack}: adapters change nothing"


def test_uniform_and_outside_a_context(setup):
    inputs, shared = denoiser_inputs(setup.model, denoiser_of(setup.pipe), 3, seed=1)
    stack = [("a", 0.7), ("b", 0.3)]
    with torch.no_grad():
        with setup.adapters.uniform(stack):
            out = denoiser_of(setup.pipe)(**inputs, **shared, return_dict=False)[0]
        plain = denoiser_of(setup.pipe)(**inputs, **shared, return_dict=False)[0]
    assert_close(out, setup.solo(stack, inputs, shared), "uniform")
    assert_close(plain, setup.solo((), inputs, shared), "outside a context")


@ONLY_SD
@pytest.mark.parametrize("method", METHODS)
def test_rows_under_autograd(setup, method):
    """With autograd on, the deltas are added out of place; the result and backward still work."""
    inputs, shared = denoiser_inputs(setup.model, denoiser_of(setup.pipe), len(STACKS))
    expected = setup.batched(STACKS, inputs, shared, method)
    setup.adapters.method = method
    sample = inputs["sample"].clone().requires_grad_()  # the adapted model's weights are frozen
    with setup.adapters.rows(STACKS):
        out = denoiser_of(setup.pipe)(**{**inputs, "sample": sample}, **shared, return_dict=False)[0]
    out.square().mean().backward()
    assert sample.grad is not None and sample.grad.abs().max() > 0
    assert_close(out.detach(), expected, "autograd")


@ONLY_SD
def test_text_encoder_rows(setup):
    stacks = [(), [("a", 1.0)], [("a", 0.3), ("b", 1.0)], [("b", 1.0)]]  # b has no text weights
    ids = torch.randint(0, 512, (len(stacks), 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with setup.adapters.rows(stacks):
            out = setup.pipe.text_encoder(ids)[0]
        for i, stack in enumerate(stacks):
            set_stack(setup.ref, stack)
            expected = setup.ref.text_encoder(ids[i:i + 1])[0]
            assert_close(out[i:i + 1], expected, f"text row {i} {stack}")
        setup.ref.disable_lora()
        assert (out[1] - setup.ref.text_encoder(ids[1:2])[0]).abs().max() > 1e-2


@ONLY_SD
def test_row_count_and_names_are_checked(setup):
    inputs, shared = denoiser_inputs(setup.model, denoiser_of(setup.pipe), 2)
    with pytest.raises(ValueError, match=r"got 2 rows .* with 3 stacks"):
        setup.batched([(), (), [("a", 1.0)]], inputs, shared)
    with pytest.raises(KeyError, match="no LoRA adapter 'nope'"):
        setup.adapters.rows([[("nope", 1.0)]])
    # The one rule of a stack, as the API's validation applies it: each adapter once.
    with pytest.raises(ValueError, match="'a' is named twice"):
        setup.adapters.rows([[("a", 0.5), ("a", 0.5)]])


def test_adapters_loaded_later_are_picked_up(tmp_path_factory):
    first = {"a": write_adapters("tiny-sd", tmp_path_factory.mktemp("later"))["a"]}
    pipe, ref = loaded("tiny-sd", first), loaded("tiny-sd", first)
    adapters = RowAdapters(pipe.unet)
    # "b" also targets layers that "a" left alone: new LoraLayers, with PEFT's application on.
    later = write_adapters("tiny-sd", tmp_path_factory.mktemp("later2"))["b"]
    for p in (pipe, ref):
        p.load_lora_weights(later, adapter_name="late")
    inputs, shared = denoiser_inputs("tiny-sd", pipe.unet, 2)
    check = Setup("tiny-sd", pipe, ref, adapters)
    stacks = [[("late", 0.5)], [("a", 1.0), ("late", 1.0)]]
    out = check.batched(stacks, inputs, shared)
    for i, stack in enumerate(stacks):
        assert_close(out[i:i + 1], check.solo(stack, row(inputs, i), shared), f"row {i}")
    with torch.no_grad():  # outside a context the new layers give the base output too
        assert_close(pipe.unet(**inputs, return_dict=False)[0], check.solo((), inputs, shared), "base")

    pipe.delete_adapters("late")
    with pytest.raises(KeyError, match="late"):
        adapters.rows([[("late", 1.0)]])
    out = check.batched([[("a", 1.0)], ()], inputs, shared)
    assert_close(out[:1], check.solo([("a", 1.0)], row(inputs, 0), shared), "after delete")

    pipe.enable_lora()  # PEFT would now add its own deltas on top
    with pytest.raises(RuntimeError, match="switched back on"), torch.no_grad():
        pipe.unet(**inputs, return_dict=False)
    adapters.close()  # gives the layers back to PEFT
    ref.enable_lora()
    ref.set_adapters(["a"])
    with torch.no_grad():
        assert_close(pipe.unet(**inputs, return_dict=False)[0],
                     ref.unet(**inputs, return_dict=False)[0], "after close")


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)


@pytest.mark.parametrize("config, error", [
    (LoraConfig(r=2, target_modules=["lin"], use_dora=True), "DoRA"),
    (LoraConfig(r=2, target_modules=["emb", "lin"]), "a peft.tuners.lora.layer.Embedding"),
])
def test_unsupported_adapters_are_refused_when_asked_for(config, error):
    model = inject_adapter_in_model(config, Toy())
    adapters = RowAdapters(model)  # loading one must not take the others down
    with pytest.raises(ValueError, match=error):
        adapters.rows([[("default", 1.0)]])
    x = torch.randn(2, 8)
    assert torch.equal(model.lin(x), model.lin.base_layer(x))  # nor apply it to every row


def test_fused_adapters_are_refused():
    config = LoraConfig(r=2, target_modules=["lin"], init_lora_weights=False)
    model = inject_adapter_in_model(config, Toy())
    model.lin.merge()
    with pytest.raises(ValueError, match="fused"):
        RowAdapters(model)


@ONLY_SD
def test_gathered_weights_are_kept_per_set_of_stacks_within_their_byte_budget(setup):
    """Two row layouts of the same distinct stacks share one copy of the gathered weights; a
    tight budget keeps the cache at most that big, and rows stay exact when entries are made
    again."""
    adapters = setup.adapters
    denoiser = denoiser_of(setup.pipe)
    stacks = [[("a", 1.0)], [("b", 0.5)], [("a", 1.0)], ()]
    inputs, shared = denoiser_inputs(setup.model, denoiser, len(stacks), seed=3)
    adapters.gathered.clear()
    first = setup.batched(stacks, inputs, shared, "gathered")
    kept, size = len(adapters.gathered._kept), adapters.gathered.nbytes
    assert kept > 0 and size > 0
    setup.batched([stacks[1], stacks[0], stacks[3], stacks[2]], inputs, shared, "gathered")
    assert adapters.gathered.nbytes == size  # another order of the same stacks: shared
    budget, adapters.gathered.budget = adapters.gathered.budget, size // 3
    try:
        again = setup.batched(stacks, inputs, shared, "gathered")
        assert adapters.gathered.nbytes <= size // 3
    finally:
        adapters.gathered.budget = budget
    assert torch.equal(again, first)
