"""Tests for aioreplica._backends: device names, resolving devices, host devices."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest
from simulated_gpus import simulated_cupy

import aioreplica
from aioreplica._backends import (
    Device,
    HostDevice,
    canonical_device_name,
    list_devices,
    resolve_devices,
)
from aioreplica.testing import FakeDevice

if TYPE_CHECKING:
    from pathlib import Path


class NotQuiteADevice:
    """Has every member of ``Device`` but ``leave``."""

    name = "odd:0"
    kind = "odd"
    index = 0
    has_context = False

    def enter(self) -> None:
        pass


class TestCanonicalDeviceName:
    @pytest.mark.parametrize(
        ("name", "expected"),
        [
            ("cpu:0", "cpu:0"),
            ("cpu:1", "cpu:1"),
            ("CPU:1", "cpu:1"),
            ("Cpu:1", "cpu:1"),
            ("/cpu:1", "cpu:1"),
            ("/CPU:1", "cpu:1"),
            ("/device:CPU:1", "cpu:1"),
            ("/device:cpu:1", "cpu:1"),
            ("device:CPU:1", "cpu:1"),
            ("/job:localhost/replica:0/task:0/device:CPU:3", "cpu:3"),
            ("cpu:12", "cpu:12"),
        ],
    )
    def test_cpu_spellings(self, name: str, expected: str) -> None:
        """Every accepted CPU spelling canonicalises to ``cpu:<i>``."""
        assert canonical_device_name(name) == expected

    @pytest.mark.parametrize(
        ("name", "expected"),
        [
            ("gpu:0", "gpu:0"),
            ("cuda:2", "gpu:2"),
            ("CUDA:2", "gpu:2"),
            ("/gpu:1", "gpu:1"),
            ("GPU:1", "gpu:1"),
            ("/device:GPU:1", "gpu:1"),
            ("/job:localhost/replica:0/task:0/device:GPU:0", "gpu:0"),
        ],
    )
    def test_gpu_spellings(self, name: str, expected: str) -> None:
        """GPU and CUDA spellings canonicalise to ``gpu:<i>`` (parsing needs no GPU)."""
        assert canonical_device_name(name) == expected

    @pytest.mark.parametrize(
        ("name", "expected"),
        [
            ("/cpu", "cpu:0"),
            ("cpu", "cpu:0"),
            ("/device:CPU", "cpu:0"),
            ("/job:localhost/replica:0/task:0/device:CPU", "cpu:0"),
            ("/gpu", "gpu:0"),
            ("GPU", "gpu:0"),
            ("cuda", "gpu:0"),
        ],
    )
    def test_name_without_index_is_device_0(self, name: str, expected: str) -> None:
        """A name without an index is device 0, as TF canonicalises it."""
        assert canonical_device_name(name) == expected

    @pytest.mark.parametrize(("name", "kind"), [("/device:CPU:*", "cpu"), ("/gpu:*", "gpu")])
    def test_any_index_is_refused_asking_for_one(self, name: str, kind: str) -> None:
        """TF's ``*`` (any device) names no one device: refused, asking for an index."""
        with pytest.raises(ValueError, match=r"has '\*' \(any device\) for its index") as info:
            canonical_device_name(name)
        assert str(info.value) == (
            f"device {name!r} has '*' (any device) for its index, which names no one device: "
            f"each replica runs on the device it names; name an index, e.g. '{kind}:0'"
        )

    def test_index_loses_leading_zeros(self) -> None:
        """The index is a number: ``cpu:01`` is ``cpu:1``."""
        assert canonical_device_name("cpu:01") == "cpu:1"

    def test_surrounding_whitespace_is_ignored(self) -> None:
        """Blanks around a name do not matter."""
        assert canonical_device_name("  /device:CPU:2\n") == "cpu:2"

    def test_canonical_name_is_a_fixed_point(self) -> None:
        """Canonicalising a canonical name returns it unchanged."""
        for name in ("cpu:0", "cpu:7", "gpu:0", "gpu:3"):
            assert canonical_device_name(canonical_device_name(name)) == name

    @pytest.mark.parametrize(
        "name",
        [
            "",
            "cpu:",
            "cpu:x",
            "cpu:-1",
            "cpu:1.5",
            "cpu0",
            "tpu:0",
            "xla_cpu:0",
            "cpu:1:2",
            "/job:localhost/replica:0/task:0",
            "/device:CPU:0/extra",
        ],
    )
    def test_unknown_name_raises_value_error_naming_it(self, name: str) -> None:
        """A string that is no device name is rejected, named, with the valid spellings."""
        with pytest.raises(
            ValueError,
            match=(
                rf"^unknown device {re.escape(repr(name))}: valid names are logical host "
                r"devices 'cpu:0', 'cpu:1', \.\.\. and the GPUs CuPy sees, 'gpu:0', 'gpu:1', "
                r"\.\.\. \(or 'cuda:0', \.\.\.\); TF spellings such as '/device:CPU:1' and "
                r"'/gpu:0' are accepted too$"
            ),
        ):
            canonical_device_name(name)

    @pytest.mark.parametrize(
        "name",
        [
            "not a device/cpu:0",
            "garbage/device:CPU:1",
            "/job:localhost/bogus/device:CPU:0",
        ],
    )
    def test_name_with_unknown_path_part_raises_value_error(self, name: str) -> None:
        """Only TF's ``/job:``, ``/replica:`` and ``/task:`` parts may precede the device."""
        with pytest.raises(ValueError, match=rf"^unknown device {re.escape(repr(name))}: "):
            canonical_device_name(name)

    @pytest.mark.parametrize(
        ("value", "type_name"),
        [(0, "int"), (None, "NoneType"), (b"cpu:0", "bytes"), (["cpu:0"], "list")],
    )
    def test_non_string_raises_type_error_naming_type_and_value(
        self, value: Any, type_name: str
    ) -> None:
        """A name that is not a str is rejected with its type and value in the message."""
        with pytest.raises(
            TypeError,
            match=rf"^a device name must be a str, got {type_name} {re.escape(repr(value))}$",
        ):
            canonical_device_name(value)

    def test_device_object_is_not_a_name(self) -> None:
        """A device object is not a device name."""
        with pytest.raises(TypeError, match=r"^a device name must be a str, got HostDevice <"):
            canonical_device_name(HostDevice(0))  # type: ignore[arg-type]


class TestResolveDevices:
    def test_none_is_one_host_device(self) -> None:
        """``None`` means the default: one host device ``cpu:0``."""
        devices = resolve_devices(None)
        assert devices == (HostDevice(0),)
        assert [d.name for d in devices] == ["cpu:0"]

    def test_names_become_host_devices_in_order(self) -> None:
        """Each name becomes its device, in the order given, as a tuple."""
        devices = resolve_devices(["cpu:2", "/device:CPU:0", "CPU:1"])
        assert type(devices) is tuple
        assert devices == (HostDevice(2), HostDevice(0), HostDevice(1))
        assert [d.name for d in devices] == ["cpu:2", "cpu:0", "cpu:1"]

    def test_tuple_of_names_is_accepted(self) -> None:
        """Any sequence of names works, not only a list."""
        assert resolve_devices(("cpu:0", "cpu:1")) == (HostDevice(0), HostDevice(1))

    @pytest.mark.parametrize("name", ["cpu:0", "/device:CPU:1"])
    def test_plain_string_raises_type_error_with_advice(self, name: str) -> None:
        """A single string is refused, and the message shows how to write it as a list."""
        with pytest.raises(
            TypeError,
            match=(
                rf"^devices must be a list of device names, got the string "
                rf"{re.escape(repr(name))}; write \[{re.escape(repr(name))}\]$"
            ),
        ):
            resolve_devices(name)

    @pytest.mark.parametrize(
        ("devices", "advice"),
        [
            (3, 'for 3 replicas on this host write devices=[f"cpu:{i}" for i in range(3)]'),
            ("cpu:0 cpu:1", "write ['cpu:0', 'cpu:1']"),
            (b"cpu:2", "write ['cpu:2']"),
            ("gpu", "write ['gpu']"),
            ("tpu", "which names no device; write a list such as ['cpu:0', 'cpu:1']"),
            (HostDevice(1), "write [device]"),
            ({"cpu:1", "cpu:0"}, "which has no order; replica ids follow the order of the list"),
            (2.5, "such as ['cpu:0', 'cpu:1'], got the float 2.5"),
        ],
    )
    def test_what_is_not_a_list_says_what_to_write(self, devices: Any, advice: str) -> None:
        """A replica count, names in one string, one device or a set is refused with the
        list to write instead."""
        with pytest.raises(TypeError, match=r"^devices must be a list of device names") as info:
            resolve_devices(devices)
        assert advice in str(info.value)

    def test_an_error_inside_the_iterable_is_its_own(self) -> None:
        """A TypeError raised while iterating the devices comes out as it is."""

        def names() -> Any:
            yield "cpu:0"
            raise TypeError("from inside the generator")

        with pytest.raises(TypeError, match=r"^from inside the generator$"):
            resolve_devices(names())

    @pytest.mark.parametrize("empty", [[], ()])
    def test_empty_raises_value_error(self, empty: list[str] | tuple[str, ...]) -> None:
        """At least one device is needed; the message points at ``None`` for the default."""
        with pytest.raises(
            ValueError,
            match=r"^devices must name at least one device; pass None for the default$",
        ):
            resolve_devices(empty)

    @pytest.mark.parametrize(
        ("devices", "name", "first", "second"),
        [
            (["cpu:0", "cpu:0"], "cpu:0", 0, 1),
            (["cpu:0", "cpu:1", "cpu:2", "cpu:1"], "cpu:1", 1, 3),
            (["cpu:1", "/device:CPU:1"], "cpu:1", 0, 1),
            (["/cpu:3", "cpu:0", "/job:localhost/replica:0/task:0/device:CPU:3"], "cpu:3", 0, 2),
            (["cpu:0", "CPU:0"], "cpu:0", 0, 1),
        ],
    )
    def test_duplicate_raises_value_error_with_positions(
        self, devices: list[str], name: str, first: int, second: int
    ) -> None:
        """The same device twice, however spelled, is named with both positions."""
        with pytest.raises(
            ValueError,
            match=(
                rf"^device '{name}' appears twice \(positions {first} and {second}\); "
                r"every replica needs its own device$"
            ),
        ):
            resolve_devices(devices)

    def test_name_and_device_object_for_the_same_device_are_duplicates(self) -> None:
        """A name and a device object with the same canonical name clash."""
        with pytest.raises(
            ValueError, match=r"^device 'cpu:0' appears twice \(positions 0 and 1\)"
        ):
            resolve_devices(["cpu:0", HostDevice(0)])

    @pytest.mark.parametrize(
        ("name", "canonical"),
        [("gpu:0", "gpu:0"), ("cuda:1", "gpu:1"), ("/device:GPU:1", "gpu:1"), ("GPU:2", "gpu:2")],
    )
    def test_gpu_name_raises_value_error_listing_available_devices(
        self, name: str, canonical: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """GPU names parse but, without CuPy, are refused with install advice and the devices
        (CuPy is hidden, so the test means the same where it is installed)."""
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda module, *args: None if module == "cupy" else find_spec(module, *args),
        )
        with pytest.raises(
            ValueError,
            match=(
                rf"^device {re.escape(repr(name))} needs CuPy, which is not installed: "
                r"pip install 'aioreplica\[cuda\]'; the devices here are \['cpu:0'\]"
            ),
        ):
            resolve_devices(["cpu:0", name])

    def test_a_cupy_that_cannot_load_is_named_and_host_devices_still_work(
        self, tmp_path: Path
    ) -> None:
        """An installed CuPy whose import fails: ``list_devices`` lists the host, and a GPU
        name is refused with the import error, not a traceback from inside the backend."""
        (tmp_path / "cupy").mkdir()
        (tmp_path / "cupy" / "__init__.py").write_text("raise ImportError('libcudart.so.12')")
        code = textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path)!r})
            import aioreplica
            print(aioreplica.list_devices())
            try:
                aioreplica.MirroredStrategy(["gpu:0"])
            except ValueError as exc:
                print(exc)
            """
        )
        completed = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=30
        )
        assert (completed.returncode, completed.stderr) == (0, "")
        assert completed.stdout.splitlines() == [
            "['cpu:0']",
            "device 'gpu:0' needs CuPy, which is installed but cannot be imported "
            "(libcudart.so.12); reinstall the cupy-cudaNNx wheel that matches your CUDA; the "
            "devices here are ['cpu:0']",
        ]

    def test_unknown_name_raises_value_error(self) -> None:
        """An unknown name in the sequence is named."""
        with pytest.raises(ValueError, match=r"^unknown device 'tpu:0': valid names are"):
            resolve_devices(["cpu:0", "tpu:0"])

    @pytest.mark.parametrize(
        ("entry", "description"),
        [(0, "int 0"), (None, "NoneType None"), (b"cpu:0", "bytes b'cpu:0'")],
    )
    def test_entry_of_wrong_type_raises_type_error_naming_it(
        self, entry: Any, description: str
    ) -> None:
        """An entry that is neither a name nor a device is named with its type."""
        with pytest.raises(
            TypeError,
            match=(
                r"^each device must be a name such as 'cpu:0' or a Device, got "
                rf"{re.escape(description)}$"
            ),
        ):
            resolve_devices(["cpu:0", entry])

    def test_object_missing_a_protocol_member_is_rejected(self) -> None:
        """An object lacking part of the ``Device`` protocol is not taken for a device."""
        with pytest.raises(
            TypeError,
            match=r"^each device must be a name such as 'cpu:0' or a Device, got NotQuiteADevice",
        ):
            resolve_devices([NotQuiteADevice()])  # type: ignore[list-item]

    def test_device_objects_are_used_as_they_are(self) -> None:
        """Objects implementing ``Device`` pass through unchanged, mixed with names."""
        fake0 = FakeDevice("fake:0", 0)
        fake1 = FakeDevice("fake:1", 1)
        host = HostDevice(5)
        devices = resolve_devices([fake0, "cpu:1", host, fake1])
        assert devices == (fake0, HostDevice(1), host, fake1)
        assert devices[0] is fake0
        assert devices[2] is host
        assert devices[3] is fake1

    def test_mixed_kinds_rejected(self) -> None:
        """One strategy's devices are all of one kind, so its collectives have one backend."""

        class OtherKind(FakeDevice):
            kind = "other"

        with pytest.raises(ValueError, match=r"devices mix kinds \['cpu', 'other'\]"):
            resolve_devices(["cpu:0", OtherKind("other:0")])

    def test_device_objects_with_the_same_name_are_duplicates(self) -> None:
        """Two device objects with one name clash like two names do."""
        with pytest.raises(
            ValueError, match=r"^device 'fake:0' appears twice \(positions 0 and 2\)"
        ):
            resolve_devices([FakeDevice("fake:0"), "cpu:0", FakeDevice("fake:0")])


class TestHostDevice:
    def test_fields(self) -> None:
        """name, kind, index and has_context describe a logical host device."""
        device = HostDevice(3)
        assert (device.name, device.kind, device.index, device.has_context) == (
            "cpu:3",
            "cpu",
            3,
            False,
        )

    def test_implements_device_protocol(self) -> None:
        """A host device is a ``Device``."""
        assert isinstance(HostDevice(0), Device)

    def test_enter_and_leave_do_nothing(self) -> None:
        """Host devices have no context to switch."""
        device = HostDevice(1)
        device.enter()
        device.leave()
        assert device == HostDevice(1)

    def test_repr_shows_name(self) -> None:
        """repr names the device."""
        assert repr(HostDevice(2)) == "<HostDevice cpu:2>"

    def test_equality_by_index(self) -> None:
        """Host devices with the same index are equal; other indices and objects are not."""
        assert HostDevice(1) == HostDevice(1)
        assert HostDevice(1) != HostDevice(2)
        others: list[object] = ["cpu:1", 1, FakeDevice("cpu:1", 1), None]
        assert [HostDevice(1) == other for other in others] == [False] * len(others)

    def test_hash_agrees_with_equality(self) -> None:
        """Equal host devices hash alike, so they work as dict keys and set members."""
        assert hash(HostDevice(4)) == hash(HostDevice(4))
        assert len({HostDevice(0), HostDevice(0), HostDevice(1)}) == 2
        assert {HostDevice(2): "x"}[HostDevice(2)] == "x"

    def test_has_no_instance_dict(self) -> None:
        """Host devices are slotted: no stray attributes."""
        device = HostDevice(0)
        with pytest.raises(AttributeError):
            device.extra = 1  # type: ignore[attr-defined]


class TestListDevices:
    def test_host_only(self) -> None:
        """Without a GPU backend the only device is ``cpu:0``."""
        assert list_devices() == ["cpu:0"]

    def test_names_are_canonical_and_resolvable(self) -> None:
        """Every listed name is canonical and resolves to a device of that name."""
        names = list_devices()
        assert [canonical_device_name(n) for n in names] == names
        assert [d.name for d in resolve_devices(names)] == names

    def test_returns_a_fresh_list(self) -> None:
        """Changing the returned list does not change the next answer."""
        names = list_devices()
        names.append("cpu:9")
        assert list_devices() == ["cpu:0"]

    def test_public_function_is_the_same(self) -> None:
        """``aioreplica.list_devices`` is this function."""
        assert aioreplica.list_devices is list_devices


class TestGpuWithoutDevices:
    def test_cupy_installed_but_no_gpu(self) -> None:
        """With CuPy but no CUDA device, a GPU name is refused with the devices that exist."""
        from aioreplica import _backends

        with simulated_cupy(0):
            with pytest.raises(
                ValueError,
                match=(
                    r"^device 'cuda:1' \(gpu:1\) does not exist: CuPy sees 0 GPUs; "
                    r"the devices here are \['cpu:0'\]$"
                ),
            ):
                resolve_devices(["cuda:1"])
            assert [d.name for d in _backends.default_devices()] == ["cpu:0"]
