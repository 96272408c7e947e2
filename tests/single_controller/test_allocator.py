"""The worker processes' C heap allocator (spec.resourcePools[].allocator): what a pool's setting resolves to on a
machine, how it reaches a process that has not started yet, and the clear error where a named one is missing. The
processes themselves: tests/single_controller/test_worker_group.py."""
import pytest

from hybridflow.api import parse_job
from hybridflow.single_controller import allocator as al
from hybridflow.trainer import preflight

HERE = {"tcmalloc": "libtcmalloc_minimal.so.4"}
NONE: dict[str, str | None] = {"tcmalloc": None}


def test_auto_takes_tcmalloc_where_the_machine_has_it_and_the_c_library_where_not():
    assert al.choose_allocator("auto", HERE, "f") == ("tcmalloc", "libtcmalloc_minimal.so.4")
    assert al.choose_allocator("auto", NONE, "f") == ("system", None)
    assert al.choose_allocator("system", HERE, "f") == ("system", None)
    assert al.choose_allocator("tcmalloc", HERE, "f") == ("tcmalloc", "libtcmalloc_minimal.so.4")


def test_an_allocator_asked_for_by_name_must_be_installed_and_the_error_says_how():
    with pytest.raises(al.AllocatorMissing) as err:
        al.choose_allocator("tcmalloc", NONE, "spec.resourcePools[1].allocator")
    assert "spec.resourcePools[1].allocator" in str(err.value)
    assert "apt-get install libtcmalloc-minimal4" in str(err.value)


def test_the_library_is_preloaded_ahead_of_what_the_node_already_preloads():
    assert al.preload_env(None) == {}
    assert al.preload_env("libtcmalloc_minimal.so.4") == {"LD_PRELOAD": "libtcmalloc_minimal.so.4:${LD_PRELOAD}"}


def test_which_allocator_serves_a_process_is_read_from_its_memory_map():
    maps = ("7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
            "7f20-7f30 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n")
    assert al.allocator_in_maps(maps) == "tcmalloc"
    assert al.allocator_in_maps(maps.splitlines()[0]) == "system"


def _job(allocators: list[str]) -> object:
    pools = [{"name": f"p{i}", "devicesPerNode": 1, "allocator": a} for i, a in enumerate(allocators)]
    return parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "a"},
                      "spec": {"resourcePools": pools, "placement": {"actor": "p0"}}})


def test_preflight_names_the_pool_whose_allocator_is_missing(monkeypatch):
    monkeypatch.setattr(preflight, "find_allocator", lambda name: None)
    problems = preflight._allocator_problems(_job(["auto", "tcmalloc", "system"]))
    assert problems == ["spec.resourcePools[1].allocator: tcmalloc is not installed on this machine (apt-get "
                        "install libtcmalloc-minimal4); or set it to auto or system"]
    monkeypatch.setattr(preflight, "find_allocator", lambda name: "libtcmalloc_minimal.so.4")
    assert preflight._allocator_problems(_job(["auto", "tcmalloc", "system"])) == []


def test_the_spec_refuses_an_allocator_it_does_not_know():
    with pytest.raises(ValueError, match="allocator"):
        _job(["jemalloc"])
