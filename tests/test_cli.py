"""The command line: check-config, run with a bad config, --version, --help."""

from __future__ import annotations

import json

import pytest

from daemon import __version__
from tests.daemonrun import REPO_ROOT, run_cli

GOOD = {"resourceList": [{"resourceName": "vfs", "selectors": {"drivers": ["iavf"]}}]}

BAD_CONFIGS = [
    ("{not json", "$: not valid JSON"),
    ("[]", "$: must be an object"),
    ("{}", "$.resourceList: is required"),
    (json.dumps({"resourceList": [{"resourceName": "x", "deviceType": "gpu", "selectors": {}}]}),
     "$.resourceList[0].deviceType: unknown deviceType 'gpu'"),
    (json.dumps({"resourceList": [{"resourceName": "bad/name", "selectors": {}}]}),
     "$.resourceList[0].resourceName: 'bad/name' may contain only"),
    (json.dumps({"resourceList": [{"resourceName": "x", "resourcePrefix": "Upper.COM", "selectors": {}}]}),
     "$.resourceList[0].resourcePrefix: resource name 'Upper.COM/x' is invalid"),
    (json.dumps({"resourceList": [{"resourceName": "x", "selectors": {}}, {"resourceName": "x", "selectors": {}}]}),
     "$.resourceList[1].resourceName: duplicate resource 'intel.com/x' (also at $.resourceList[0])"),
    (json.dumps({"resourceList": [{"resourceName": "x"}]}), "$.resourceList[0].selectors: is required"),
    (json.dumps({"resourceList": [{"resourceName": "x", "selectors": {"vendors": "8086"}}]}),
     "$.resourceList[0].selectors.vendors: must be a list, not '8086'"),
    (json.dumps({"resourceList": [{"resourceName": "x", "excludeTopology": "yes", "selectors": {}}]}),
     "$.resourceList[0].excludeTopology: must be a boolean"),
    (json.dumps({"resourceList": [{"resourceName": "x", "deviceType": "pciDevice",
                                   "selectors": [{}, {"classes": ["0108", "nvme"]}]}]}),
     "$.resourceList[0].selectors[1].classes[1]: 'nvme' is not a class code prefix"),
    (json.dumps({"resourceList": [{"resourceName": "x", "allocationPolicy": "tight", "selectors": {}}]}),
     "$.resourceList[0].allocationPolicy: unknown allocation policy 'tight' (expected one of: packed, spread)"),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_check_config_exits_2_naming_the_json_path(short_tmp, text, message):
    path = short_tmp / "config.json"
    path.write_text(text)
    result = run_cli("check-config", str(path))
    assert result.returncode == 2
    assert f"config {path}: {message}" in result.stderr
    assert result.stderr.count("\n") == 1  # one message


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS[:3] + BAD_CONFIGS[6:8])
def test_run_with_a_bad_config_exits_2_with_the_same_message(short_tmp, text, message):
    path = short_tmp / "config.json"
    path.write_text(text)
    result = run_cli("run", "--config", str(path), "--device-plugin-dir", str(short_tmp / "dp"),
                     "--registration", "none")
    assert result.returncode == 2
    assert f"config {path}: {message}" in result.stderr
    assert not (short_tmp / "dp").exists()


def test_check_config_accepts_a_valid_file_and_lists_pools(short_tmp):
    path = short_tmp / "config.json"
    path.write_text(json.dumps(GOOD))
    result = run_cli("check-config", str(path), "--resource-prefix", "example.com")
    assert result.returncode == 0
    assert "example.com/vfs\tnetDevice" in result.stdout


def test_check_config_of_a_missing_file(short_tmp):
    result = run_cli("check-config", str(short_tmp / "absent.json"))
    assert result.returncode == 2
    assert "cannot read" in result.stderr


def test_empty_selector_list_drops_only_that_pool_with_a_warning(short_tmp):
    path = short_tmp / "config.json"
    path.write_text(json.dumps({"resourceList": [{"resourceName": "empty", "selectors": []}, GOOD["resourceList"][0]]}))
    result = run_cli("check-config", str(path))
    assert result.returncode == 0
    assert "$.resourceList[0].selectors: is an empty list; pool 'intel.com/empty' is skipped" in result.stderr
    assert "intel.com/vfs" in result.stdout and "intel.com/empty" not in result.stdout


def test_bundled_default_config_is_valid():
    result = run_cli("check-config", str(REPO_ROOT / "config" / "default.json"))
    assert result.returncode == 0, result.stderr
    assert "devplugd.io/kvm\tdevNode" in result.stdout


def test_version_and_help_name_every_flag():
    assert run_cli("--version").stdout.strip() == f"devplugd {__version__}"
    help_text = run_cli("run", "--help").stdout
    for flag in ("--config", "--resource-prefix", "--sysfs-root", "--dev-root", "--device-plugin-dir",
                 "--plugins-registry-dir", "--registration", "--devinfo-dir", "--cdi-dir", "--state-dir"):
        assert flag in help_text
