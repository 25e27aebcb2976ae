"""Optional extras (plot, client, redis): a feature whose extra is missing names the extra to install, in one line;
from the command line that line is the error and the exit code is 2."""

import subprocess
import sys

import pytest

from kvflow.errors import ConfigError
from kvflow.extras import EXTRAS, require

from tests.cli.test_cli import assert_one_line_error


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_a_missing_extra_is_one_config_error_naming_it(extra, monkeypatch):
    module = EXTRAS[extra][0]
    monkeypatch.setitem(sys.modules, module, None)          # what `import module` finds when it is not installed
    with pytest.raises(ConfigError) as err:
        require(extra)
    message = str(err.value)
    assert "\n" not in message and repr(module) in message and f"pip install 'kvflow[{extra}]'" in message


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_an_installed_extra_is_its_module(extra):
    module = pytest.importorskip(EXTRAS[extra][0])
    assert require(extra) is module


def test_a_broken_install_is_not_reported_as_a_missing_extra(monkeypatch, tmp_path):
    (tmp_path / "kvflow_fake_plotter.py").write_text("import kvflow_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(EXTRAS, "fake", ("kvflow_fake_plotter", "a fake feature"))
    with pytest.raises(ModuleNotFoundError) as err:             # the real cause, not "pip install 'kvflow[fake]'"
        require("fake")
    assert err.value.name == "kvflow_no_such_dependency"


def test_a_pool_with_a_remote_tier_but_no_redis_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "kvflow.yaml"
    config.write_text(f"pool:\n  index_dir: {tmp_path / 'index'}\n  devices:\n"
                      "    - {type: memory, capacity: 64M}\n"
                      "    - {type: remote, url: 'redis://127.0.0.1:1'}\n")
    without_redis = ("import sys; sys.modules['redis'] = None\n"
                     "from kvflow.cli.main import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", without_redis, "pool", "init", str(config)], capture_output=True,
                          text=True, timeout=300)
    assert_one_line_error(proc, "pip install 'kvflow[redis]'")
