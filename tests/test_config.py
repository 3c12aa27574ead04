"""The pool config file, read as the SR-IOV network device plugin reads it (unit tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from daemon.core import HandlerContext
from daemon.core._config import ConfigFileError, DaemonConfig, load_config, parse_config
from daemon.core._names import extended_resource_name_problem
from daemon.core._registry import load_handlers, parser_table

_CONTEXT = HandlerContext(
    sysfs_root=Path("/nonexistent/sys"),
    dev_root=Path("/nonexistent/dev"),
    proc_root=Path("/nonexistent/proc"),
    devinfo_dir=Path("/nonexistent/devinfo"),
)
PARSERS = parser_table(load_handlers(_CONTEXT))


def parse(document: Any, prefix: str = "intel.com") -> DaemonConfig:
    text = document if isinstance(document, str) else json.dumps(document)
    return parse_config(text, "pools.json", prefix, PARSERS)


def parse_error(document: Any, prefix: str = "intel.com") -> ConfigFileError:
    with pytest.raises(ConfigFileError) as caught:
        parse(document, prefix)
    return caught.value


def pools(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"resourceList": list(entries)}


def pool(name: str = "sriov_a", **fields: Any) -> dict[str, Any]:
    return {"resourceName": name, "selectors": {"vendors": ["8086"]}, **fields}


# -- what valid files mean --------------------------------------------------------------------


def test_operator_written_keys_in_any_case_are_understood() -> None:
    config = parse({
        "resourceList": [
            {"RESOURCENAME": "a", "ResourcePrefix": "example.org", "DEVICETYPE": "netDevice",
             "ExcludeTopology": True, "SelectorObjs": [{"Vendors": ["15b3"]}],
             "Selectors": {"VENDORS": ["8086"], "IsRdma": True, "NeedVhostNet": True}},
            {"resourceName": "b", "selectors": [{"ISRDMA": True, "pfnames": ["ens1f0#0-3"]}]},
        ],
        "SelectorObj": None,
    })
    first, second = config.pools
    assert first.resource == "example.org/a"
    assert first.entry.exclude_topology is True
    (selector,) = first.spec.selectors
    assert (selector.vendors, selector.is_rdma, selector.need_vhost_net) == (("8086",), True, True)
    (selector,) = second.spec.selectors
    assert (selector.is_rdma, selector.pf_names) == (True, ("ens1f0#0-3",))
    assert config.warnings == ()


@pytest.mark.parametrize(
    ("text", "resource", "is_rdma"),
    [
        ('{"resourceList": [{"resourceName": "a", "ResourceName": "b", "selectors": {}}]}', "intel.com/b", False),
        ('{"resourceList": [{"resourceName": "a", "selectors": {"isRdma": true, "IsRdma": false}}]}',
         "intel.com/a", False),
    ],
    ids=["resourceName", "isRdma"],
)
def test_key_repeated_in_another_case_takes_the_last_value_as_go_does(
    text: str, resource: str, is_rdma: bool
) -> None:
    # encoding/json decodes every key in file order into the field it folds to: the last one wins.
    (configured,) = parse(text).pools
    assert configured.resource == resource
    assert configured.spec.selectors[0].is_rdma is is_rdma


def test_unknown_keys_are_ignored_at_every_level() -> None:
    config = parse({
        "resourceList": [pool("a", color="blue", selectors={"vendors": ["8086"], "futureField": [1, 2]})],
        "SelectorObj": None,
        "version": 7,
    })
    assert [p.resource for p in config.pools] == ["intel.com/a"]
    assert config.pools[0].spec.selectors[0].vendors == ("8086",)


@pytest.mark.parametrize(
    ("selectors", "paths"),
    [
        ({"drivers": ["iavf"]}, ["$.resourceList[0].selectors"]),
        ([{"drivers": ["iavf"]}], ["$.resourceList[0].selectors[0]"]),
        ([{"drivers": ["iavf"]}, {"drivers": ["vfio-pci"]}],
         ["$.resourceList[0].selectors[0]", "$.resourceList[0].selectors[1]"]),
    ],
)
def test_selectors_may_be_one_object_or_a_list_of_objects(selectors: Any, paths: list[str]) -> None:
    (configured,) = parse(pools(pool(selectors=selectors))).pools
    assert [selector.json_path for selector in configured.spec.selectors] == paths


@pytest.mark.parametrize("fields", [{}, {"deviceType": ""}, {"deviceType": None}, {"deviceType": "netDevice"}])
def test_absent_or_empty_device_type_means_net_device(fields: dict[str, Any]) -> None:
    (configured,) = parse(pools(pool(**fields))).pools
    assert (configured.entry.device_type, configured.handler) == ("netDevice", "pci")


def test_accelerator_devnode_and_aux_net_device_pools_go_to_their_handlers() -> None:
    config = parse(pools(
        pool("qat", deviceType="accelerator"),
        {"resourceName": "kvm", "deviceType": "devNode", "selectors": {"paths": ["/dev/kvm"]}},
        {"resourceName": "bf_sfs", "deviceType": "auxNetDevice", "selectors": [{"pfNames": ["p0#1-4"], "auxTypes": ["sf"]}]},
    ))
    assert [(p.resource, p.handler) for p in config.pools] == [
        ("intel.com/qat", "pci"), ("intel.com/kvm", "devnode"), ("intel.com/bf_sfs", "auxnet")]


@pytest.mark.parametrize(
    ("fields", "resource"),
    [
        ({}, "intel.com/sriov_a"),
        ({"resourcePrefix": ""}, "intel.com/sriov_a"),
        ({"resourcePrefix": None}, "intel.com/sriov_a"),
        ({"resourcePrefix": "example.org"}, "example.org/sriov_a"),
    ],
)
def test_pool_prefix_overrides_the_default_prefix(fields: dict[str, Any], resource: str) -> None:
    (configured,) = parse(pools(pool(**fields))).pools
    assert configured.resource == resource
    assert configured.entry.resource_prefix == resource.split("/")[0]


def test_default_prefix_from_the_command_line_is_used() -> None:
    (configured,) = parse(pools(pool()), prefix="nvidia.com").pools
    assert configured.resource == "nvidia.com/sriov_a"


def test_resource_names_with_dashes_are_accepted_as_upstream_does() -> None:
    (configured,) = parse(pools(pool("fast-vfs_2"))).pools
    assert configured.resource == "intel.com/fast-vfs_2"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"additionalInfo": None}, None),
        ({"additionalInfo": {}}, {}),
        ({"additionalInfo": {"*": {"site": "rack12"}, "0000:3b:02.1": {"site": "special", "x": ""}}},
         {"*": {"site": "rack12"}, "0000:3b:02.1": {"site": "special", "x": ""}}),
    ],
)
def test_additional_info_absent_is_none_and_empty_is_kept(fields: dict[str, Any], expected: Any) -> None:
    (configured,) = parse(pools(pool(**fields))).pools
    info = configured.entry.additional_info
    if expected is None:
        assert info is None
    else:
        assert info is not None
        assert {key: dict(values) for key, values in info.items()} == expected


def test_additional_info_keys_are_case_sensitive_like_a_go_map() -> None:
    document = pools(pool(additionalInfo={"0000:3B:02.1": {"k": "upper"}, "0000:3b:02.1": {"k": "lower"}}))
    (configured,) = parse(document).pools
    info = configured.entry.additional_info
    assert dict(info["0000:3B:02.1"]) == {"k": "upper"}
    assert dict(info["0000:3b:02.1"]) == {"k": "lower"}


# -- bad input: one error naming the JSON path and the reason ---------------------------------


@pytest.mark.parametrize(
    ("document", "json_path", "reason"),
    [
        ("{not json", "$", "not valid JSON"),
        ("", "$", "not valid JSON"),
        ("[]", "$", "must be an object"),
        ('"resourceList"', "$", "must be an object"),
        ({}, "$.resourceList", "is required"),
        ({"resourceList": {}}, "$.resourceList", "must be a list"),
        ({"resourceList": [5]}, "$.resourceList[0]", "must be an object"),
        (pools({"selectors": {}}), "$.resourceList[0].resourceName", "is required"),
        (pools(pool(5)), "$.resourceList[0].resourceName", "must be a string"),
        (pools(pool(selectors={"vendors": "8086"})), "$.resourceList[0].selectors.vendors", "must be a list"),
        (pools(pool(selectors={"vendors": [8086]})), "$.resourceList[0].selectors.vendors[0]", "must be a string"),
        (pools(pool(selectors=[{}, {"drivers": "vfio-pci"}])), "$.resourceList[0].selectors[1].drivers",
         "must be a list"),
        (pools(pool(selectors={"isRdma": "true"})), "$.resourceList[0].selectors.isRdma", "must be a boolean"),
        (pools(pool(selectors={"pfNames": [["ens1f0"]]})), "$.resourceList[0].selectors.pfNames[0]",
         "must be a string"),
        (pools(pool(excludeTopology="yes")), "$.resourceList[0].excludeTopology", "must be a boolean"),
        (pools(pool(deviceType=5)), "$.resourceList[0].deviceType", "must be a string"),
        (pools(pool(resourcePrefix=["intel.com"])), "$.resourceList[0].resourcePrefix", "must be a string"),
        (pools(pool(additionalInfo=[])), "$.resourceList[0].additionalInfo", "must be an object"),
        (pools(pool(additionalInfo={"*": "site"})), "$.resourceList[0].additionalInfo.*", "must be an object"),
        (pools(pool(additionalInfo={"*": {"site": 12}})), "$.resourceList[0].additionalInfo.*.site",
         "must be a string"),
        (pools(pool(), pool("b", selectors=None)), "$.resourceList[1].selectors", "is required"),
        (pools({"resourceName": "a"}), "$.resourceList[0].selectors", "is required"),
    ],
)
def test_bad_file_names_json_path_and_reason(document: Any, json_path: str, reason: str) -> None:
    error = parse_error(document)
    assert error.json_path == json_path
    assert str(error).startswith(f"config pools.json: {json_path}: ")
    assert reason in str(error)


def test_a_document_nested_too_deeply_to_parse_is_a_config_error() -> None:
    error = parse_error("[" * 200_000)  # CPython's parser raises RecursionError, not a ValueError
    assert str(error) == "config pools.json: $: not valid JSON: nested too deeply to parse"


def test_unknown_device_type_lists_the_known_types() -> None:
    error = parse_error(pools(pool(), pool("b", deviceType="gpu")))
    assert error.json_path == "$.resourceList[1].deviceType"
    assert "'gpu'" in str(error)
    assert "(known: accelerator, auxNetDevice, devNode, netDevice, pciDevice, usbDevice)" in str(error)


@pytest.mark.parametrize("name", ["sriov.net", "sriov/net", "sriov net", "", "vf\u00e9", "a:b"])
def test_resource_name_outside_upstream_charset_is_refused(name: str) -> None:
    error = parse_error(pools(pool(name)))
    assert error.json_path == "$.resourceList[0].resourceName"
    assert "letters, digits, '_' and '-'" in str(error)


@pytest.mark.parametrize(
    ("fields", "json_path", "reason"),
    [
        ({"resourcePrefix": "Intel.com"}, "$.resourceList[0].resourcePrefix", "lower-case DNS subdomain"),
        ({"resourcePrefix": "kubernetes.io"}, "$.resourceList[0].resourcePrefix", "kubernetes.io/"),
        ({"resourcePrefix": "gpu.kubernetes.io"}, "$.resourceList[0].resourcePrefix", "kubernetes.io/"),
        ({"resourcePrefix": "intel.com/extra"}, "$.resourceList[0].resourcePrefix", "exactly one '/'"),
        ({"resourcePrefix": "intel_com"}, "$.resourceList[0].resourcePrefix", "lower-case DNS subdomain"),
        ({"resourceName": "a" * 64}, "$.resourceList[0].resourceName", "1-63 characters"),
        ({"resourceName": "-vf"}, "$.resourceList[0].resourceName", "starting and ending"),
    ],
)
def test_resource_the_kubelet_would_refuse_is_an_error(fields: dict[str, Any], json_path: str, reason: str) -> None:
    error = parse_error(pools({**pool(), **fields}))
    assert error.json_path == json_path
    assert reason in str(error)


def test_bad_default_prefix_is_reported_at_the_resource_name() -> None:
    error = parse_error(pools(pool()), prefix="Intel.com")
    assert error.json_path == "$.resourceList[0].resourceName"
    assert "'Intel.com/sriov_a'" in str(error)


@pytest.mark.parametrize(
    "second",
    [pool("sriov_a"), pool("sriov_a", resourcePrefix="intel.com"), pool("sriov_a", deviceType="accelerator")],
)
def test_duplicate_resource_is_an_error_naming_both_entries(second: dict[str, Any]) -> None:
    error = parse_error(pools(pool("sriov_a"), pool("other"), second))
    assert error.json_path == "$.resourceList[2].resourceName"
    assert "duplicate resource 'intel.com/sriov_a'" in str(error)
    assert "$.resourceList[0]" in str(error)


def test_duplicate_created_by_prefix_override_is_an_error() -> None:
    error = parse_error(pools(pool("a", resourcePrefix="example.org"), pool("a")), prefix="example.org")
    assert error.json_path == "$.resourceList[1].resourceName"
    assert "'example.org/a'" in str(error)


def test_same_name_under_different_prefixes_is_allowed() -> None:
    config = parse(pools(pool("a"), pool("a", resourcePrefix="example.org")))
    assert [p.resource for p in config.pools] == ["intel.com/a", "example.org/a"]


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as caught:
        load_config(tmp_path / "missing.json", "intel.com", PARSERS)
    assert "cannot read" in str(caught.value)
    assert str(tmp_path / "missing.json") in str(caught.value)


def test_load_config_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(pools(pool("a"))))
    config = load_config(path, "intel.com", PARSERS)
    assert (config.source, [p.resource for p in config.pools]) == (str(path), ["intel.com/a"])


# -- upstream leniency: an unusable selectors value drops only that pool ----------------------


@pytest.mark.parametrize(
    ("selectors", "reason"),
    [
        ([], "is an empty list"),
        (5, "must be an object or a list of objects, not 5"),
        ("x", "not 'x'"),
        ([{"vendors": ["8086"]}, 7], "must be an object or a list of objects"),
        ([[{"vendors": ["8086"]}]], "must be an object or a list of objects"),
    ],
)
def test_unusable_selectors_drop_only_that_pool_with_a_warning(selectors: Any, reason: str) -> None:
    config = parse(pools(pool("first"), pool("broken", selectors=selectors), pool("last")))
    assert [p.resource for p in config.pools] == ["intel.com/first", "intel.com/last"]
    (warning,) = config.warnings
    assert warning.startswith("$.resourceList[1].selectors: ")
    assert reason in warning
    assert "'intel.com/broken'" in warning


def test_file_with_only_dropped_pools_has_no_pools_but_all_warnings() -> None:
    config = parse(pools(pool("a", selectors=[]), pool("b", selectors=[])))
    assert config.pools == ()
    assert [w.split(":")[0] for w in config.warnings] == ["$.resourceList[0].selectors", "$.resourceList[1].selectors"]


# -- the kubelet's extended resource name rules -----------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["vendor.com/gpu", "example.com/Foo_bar.v2", "intel.com/sriov-net_A", "a/b", "x.y.z/" + "n" * 63],
)
def test_valid_extended_resource_names(name: str) -> None:
    assert extended_resource_name_problem(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "gpu",
        "kubernetes.io/gpu",
        "foo.kubernetes.io/x",
        "Vendor.com/gpu",
        "vendor.com/a/b",
        "vendor.com/-x",
        "vendor.com/x-",
        "vendor.com/" + "a" * 64,
        "vendor.com/",
        "requests.foo/x",
        "vendor..com/gpu",
        "-vendor.com/gpu",
        "vendor.com/g pu",
        "a" * 250 + ".com/gpu",
    ],
)
def test_invalid_extended_resource_names(name: str) -> None:
    problem = extended_resource_name_problem(name)
    assert isinstance(problem, str) and problem


def test_a_handler_that_fails_to_parse_its_pool_refuses_the_file_naming_the_pool() -> None:
    def broken_parser(entry: Any) -> Any:
        raise ZeroDivisionError("division by zero")

    document = {"resourceList": [{"resourceName": "ok", "deviceType": "devNode", "selectors": {"paths": ["/dev/kvm"]}},
                                 {"resourceName": "bad", "deviceType": "broken", "selectors": {}}]}
    parsers = {**PARSERS, "broken": ("broken", broken_parser)}
    with pytest.raises(ConfigFileError) as error:
        parse_config(json.dumps(document), "test.json", "intel.com", parsers)
    assert error.value.json_path == "$.resourceList[1]"
    assert str(error.value) == ("config test.json: $.resourceList[1]: handler broken failed to parse this pool: "
                                "ZeroDivisionError: division by zero")


# -- allocationApi: which road a pool's devices take --------------------------------------------


def test_allocation_api_defaults_to_the_device_plugin_api_and_takes_dra() -> None:
    config = parse(pools(pool("a"), pool("b", allocationApi="dra"), pool("c", AllocationAPI="devicePlugin")))
    assert [p.entry.allocation_api for p in config.pools] == ["devicePlugin", "dra", "devicePlugin"]
    assert [p.resource for p in config.dra_pools] == ["intel.com/b"]


def test_an_unknown_allocation_api_is_refused_with_its_path() -> None:
    error = parse_error(pools(pool("a"), pool("b", allocationApi="DRA")))
    assert error.json_path == "$.resourceList[1].allocationApi"
    assert "'devicePlugin' or 'dra'" in str(error) and "'DRA'" in str(error)


def test_unhealthy_taint_defaults_to_no_schedule_and_takes_the_three_effects_and_omit() -> None:
    config = parse(pools(pool("a", allocationApi="dra"), pool("b", allocationApi="dra", unhealthyTaint="NoExecute"),
                         pool("c", allocationApi="dra", unhealthyTaint="None"), pool("d", unhealthyTaint="omit")))
    assert [p.entry.unhealthy_taint for p in config.pools] == ["NoSchedule", "NoExecute", "None", "omit"]


def test_a_mistyped_unhealthy_taint_is_refused_naming_the_key_and_the_choices() -> None:
    error = parse_error(pools(pool("a", allocationApi="dra", unhealthyTaint="noschedule")))
    assert error.json_path == "$.resourceList[0].unhealthyTaint"
    assert "'NoSchedule', 'NoExecute', 'None', 'omit'" in str(error) and "'noschedule'" in str(error)
    assert parse_error(pools(pool("a", unhealthyTaint=True))).json_path == "$.resourceList[0].unhealthyTaint"


def test_dra_pools_whose_slice_pool_names_would_collide_are_refused() -> None:
    # intel.com/sriov_vfs and intel.com/sriov-vfs are both the pool <node>/intel.com/sriov-vfs
    error = parse_error(pools(pool("sriov_vfs", allocationApi="dra"), pool("sriov-vfs", allocationApi="dra")))
    assert error.json_path == "$.resourceList[1].allocationApi"
    assert "intel.com/sriov-vfs" in str(error) and "$.resourceList[0]" in str(error)


def test_the_same_names_are_fine_while_one_of_them_is_a_device_plugin_pool() -> None:
    config = parse(pools(pool("sriov_vfs", allocationApi="dra"), pool("sriov-vfs")))
    assert len(config.pools) == 2

