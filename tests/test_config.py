import dataclasses
import subprocess
import sys

import pytest

from diffserve.cli import build_parser, main
from diffserve.config.flags import ConfigError, ServerConfig
from diffserve.config.executors import executor_threads


def test_defaults_are_valid():
    config = ServerConfig()
    assert config.dynamic_batch_max_size == 8 and config.host == "127.0.0.1"


@pytest.mark.parametrize("values, flag", [
    ({"dynamic_batch_max_size": 0}, "--dynamic-batch-max-size=0"),
    ({"dynamic_batch_delay_ms": -1.0}, "--dynamic-batch-delay-ms=-1.0"),
    ({"port": 70000}, "--port=70000"),
    ({"dtype": "int3"}, "--dtype='int3'"),
])
def test_out_of_bounds_values_name_the_flag_and_value(values, flag):
    with pytest.raises(ConfigError) as excinfo:
        ServerConfig(**values)
    assert flag in str(excinfo.value)


def test_cli_maps_flags_to_config_fields():
    args = build_parser().parse_args(["serve", "--dynamic-batch-max-size", "4",
                                      "--dynamic-batch-delay-ms", "2.5", "--model", "tiny-flux"])
    config = ServerConfig.from_mapping(vars(args))
    assert (config.dynamic_batch_max_size, config.dynamic_batch_delay_ms, config.model) == (4, 2.5, "tiny-flux")
    assert config.port == 8000  # unset flags keep the dataclass default


def test_bad_flag_value_exits_2_with_the_message(capsys):
    assert main(["serve", "--dynamic-batch-max-size", "0"]) == 2
    assert "--dynamic-batch-max-size=0" in capsys.readouterr().err


def test_help_lists_every_flag_with_help_default_and_bounds():
    out = subprocess.run([sys.executable, "-m", "diffserve", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    import dataclasses

    for f in dataclasses.fields(ServerConfig):
        assert "--" + f.name.replace("_", "-") in out
    flat = " ".join(out.split())
    assert "Default: 8. Bounds: >= 1, <= 1024." in flat
    assert "Default: 8.0. Bounds: >= 0, <= 60000." in flat


def test_the_configuration_page_lists_every_flag_with_its_default():
    """docs/configuration.md's flag table ("## Flags"), which the README links to."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    table = page.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[a-z-]+)` \| ([^|]*) \|", table, re.M)}
    flags = {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(ServerConfig)}
    assert set(rows) == set(flags)
    for flag, f in flags.items():
        shown = rows[flag].strip()
        if f.default in ("", ()):
            assert shown.startswith("unset") or shown.startswith("`--"), (flag, shown)
        elif isinstance(f.default, bool):
            assert shown.split()[0] == ("on" if f.default else "off"), (flag, shown)
        elif isinstance(f.default, str):
            assert shown.startswith(f"`{f.default}`"), (flag, shown)
        else:
            assert shown.split()[0] == (str(f.default) if isinstance(f.default, int) else f"{f.default:g}"), (flag, shown)


def test_data_parallel_size_and_devices_agree():
    assert ServerConfig(devices="cuda:0,cuda:1").num_executors == 2
    assert ServerConfig(data_parallel_size=3).executor_devices() == ["auto"] * 3
    assert executor_threads(ServerConfig(data_parallel_size=2, torch_threads=0), 8) == 4
    assert executor_threads(ServerConfig(torch_threads=0), 8) == 0  # one executor: torch decides
    with pytest.raises(ConfigError, match="names 2 devices but --data-parallel-size=3"):
        ServerConfig(devices="cuda:0,cuda:1", data_parallel_size=3)
    for devices in ("cuda:0,,cuda:1", "cuda:0, "):  # a blank entry is empty too
        with pytest.raises(ConfigError, match="empty entry"):
            ServerConfig(devices=devices)
    assert ServerConfig(devices="cuda:0, cuda:1").executor_devices() == ["cuda:0", "cuda:1"]


def test_stages_on_are_refused_in_a_parallel_group():
    assert ServerConfig().stages == "auto" and ServerConfig(stages="off").stages == "off"
    with pytest.raises(ConfigError, match="--stages on with a parallel group"):
        ServerConfig(stages="on", ulysses_degree=2, devices="cpu,cpu")
    assert ServerConfig(stages="auto", ulysses_degree=2, devices="cpu,cpu").degrees.size == 2


def test_lora_flags_parse_and_check_each_other():
    from diffserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x", "b=/y/z.safetensors",
                                      "--enable-lora-runtime-updates", "--lora-dir", "/srv/loras"])
    config = ServerConfig.from_mapping(vars(args))
    assert config.lora_adapters == {"a": "/x", "b": "/y/z.safetensors"}
    assert config.enable_lora_runtime_updates is True
    assert ServerConfig.from_mapping(vars(build_parser().parse_args(["serve"]))).lora_modules == ()
    for values, message in [
        ({"lora_modules": ("nameonly",)}, "is not NAME=PATH"),
        ({"lora_modules": ("a=/x", "a=/y")}, "names 'a' twice"),
        ({"lora_modules": ("shapes=/x",)}, "the served model's own name"),
        ({"max_loras": 2, "max_loras_per_request": 3}, "--max-loras=2"),
        ({"enable_lora_runtime_updates": True}, "needs --lora-dir"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ServerConfig(**values)


def test_switches_and_lists_parse_from_text_as_ray_arguments_arrive():
    from diffserve.config.flags import parse_value

    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    assert parse_value(fields["enable_lora_runtime_updates"], "true") is True
    assert parse_value(fields["enable_lora_runtime_updates"], "0") is False
    assert parse_value(fields["lora_modules"], "a=/x, b=/y") == ("a=/x", "b=/y")
    with pytest.raises(ConfigError, match="not true or false"):
        parse_value(fields["enable_lora_runtime_updates"], "maybe")


def test_a_quantization_that_cannot_run_here_stops_the_start_with_one_line(tmp_path):
    """fp8 on a CPU: the start fails with the reason, said once by the executor without a
    traceback (and once by the server as it gives up), and nothing of torchao's import noise."""
    from diffserve.serving.launcher import LaunchError, ServerProcess, diffserve_command
    from diffserve.ports import free_port

    pytest.importorskip("torchao")
    port = free_port()
    server = ServerProcess(diffserve_command("--port", str(port), "--model", "tiny-sd",
                                             "--device", "cpu", "--quantization",
                                             "fp8-weight-only"),
                           port, tmp_path / "server.log", env={"OMP_NUM_THREADS": "1"},
                           startup_timeout_s=120)
    with pytest.raises(LaunchError):
        server.launch().wait_ready()
    log = server.log
    assert log.count("fp8-weight-only needs a CUDA GPU") == 2, log
    assert "Traceback" not in log and "_C_mxfp8" not in log and "Unable to import" not in log


def test_several_models_parse_from_repeated_flags_and_each_engine_gets_its_own():
    args = build_parser().parse_args(["serve", "--model", "a=tiny-sd", "--model",
                                      "b=random:flux.1-dev:tiny", "--resident-models", "1",
                                      "--lora-modules", "l=/x", "--controlnet", "c=tiny-sd-control"])
    config = ServerConfig.from_mapping(vars(args))
    assert config.served_models == {"a": "tiny-sd", "b": "random:flux.1-dev:tiny"}
    assert config.model_name == "a"
    first, second = config.for_model("a"), config.for_model("b")
    assert (first.model, first.model_name, first.lora_modules, first.controlnet) == (
        "tiny-sd", "a", ("l=/x",), ("c=tiny-sd-control",))
    assert (second.model, second.model_name, second.lora_modules, second.controlnet) == (
        "random:flux.1-dev:tiny", "b", (), ())
    assert first.enable_weight_updates and second.enable_weight_updates  # they sleep for swaps
    one = ServerConfig(model="x=tiny-sd")  # one model named by NAME=PATH
    assert one.model_name == "x" and one.for_model("x").model == "tiny-sd"
    assert ServerConfig(model="tiny-sd").for_model("tiny-sd").model == "tiny-sd"
    for values, message in [
        ({"model": "a=tiny-sd,a=tiny-sdxl"}, "names 'a' twice"),
        ({"model": "a=tiny-sd,b=tiny-sdxl", "served_model_name": "x"}, "--served-model-name"),
        ({"model": "a=tiny-sd,b=tiny-sdxl", "enable_weight_updates": True, "weights_dir": "/w"},
         "which model"),
        ({"model": "a=tiny-sd,b=tiny-sdxl", "resident_models": 1, "compile": True}, "--compile"),
        ({"model": "a=tiny-sd,b=tiny-sdxl", "resident_model_bytes": 1 << 30,
          "quantization": "int8-weight-only"}, "--quantization"),
        ({"model": "a=tiny-sd,b=random:nope"}, "no random architecture"),
        ({"model": "a=tiny-sd,b=tiny-sdxl", "lora_modules": ("b=/x",)}, "which --model names"),
        ({"model": "a=tiny-sd,b=tiny-sdxl", "resident_host_bytes": 1}, "none sleeps"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ServerConfig(**values)


def test_several_models_with_data_parallel_executors_each_run_every_executor():
    """--data-parallel-size N with several models: each model's engine starts N executors, on
    the same devices (executor i of every model on device i); a swap sleeps or wakes a model on
    all of its executors. Tensor parallelism is refused where models are swapped."""
    config = ServerConfig(model="a=tiny-sd,b=tiny-sdxl", data_parallel_size=2,
                          devices="cuda:0,cuda:1", resident_models=1)
    for name in ("a", "b"):
        engine = config.for_model(name)
        assert engine.num_executors == 2
        assert engine.executor_devices() == ["cuda:0", "cuda:1"]
    ServerConfig(model="a=tiny-sd,b=tiny-sdxl", tensor_parallel_size=2, devices="cuda:0,cuda:1")
    with pytest.raises(ConfigError, match="--tensor-parallel-size with --resident-models"):
        ServerConfig(model="a=tiny-sd,b=tiny-sdxl", tensor_parallel_size=2,
                     devices="cuda:0,cuda:1", resident_models=1)
