import subprocess
import sys

import pytest

from diffserve.cli import build_parser, main
from diffserve.config import ConfigError, ServerConfig


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
