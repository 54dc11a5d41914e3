"""The cluster resolver's cluster spec, as TF's ``tf.train.ClusterSpec`` reads."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from aioreplica import Cluster, ClusterSpec


class TestClusterSpec:
    def test_reads_as_tfs(self) -> None:
        """as_dict, jobs, num_tasks, task_indices, task_address and job_tasks answer as TF's
        ClusterSpec does for one worker job of one task per rank."""
        spec = Cluster(worker_index=1, num_workers=3).cluster_spec()
        answers = [
            spec.as_dict(),
            spec.jobs,
            spec.num_tasks("worker"),
            spec.task_indices("worker"),
            spec.task_address("worker", 2),
            spec.job_tasks("worker"),
        ]
        assert answers == [
            {"worker": ["rank 0", "rank 1", "rank 2"]},
            ["worker"],
            3,
            [0, 1, 2],
            "rank 2",
            ["rank 0", "rank 1", "rank 2"],
        ]

    def test_is_a_mapping_equal_to_its_dict(self) -> None:
        """Code that used the spec as a dict keeps working: indexing, iteration, len, ==."""
        spec = Cluster(worker_index=0, num_workers=2).cluster_spec()
        assert isinstance(spec, Mapping)
        assert spec == {"worker": ["rank 0", "rank 1"]}
        assert {"worker": ["rank 0", "rank 1"]} == spec  # noqa: SIM300 - the dict's == first
        assert spec != {"worker": ["rank 0"]}
        assert (list(spec), len(spec), spec["worker"], dict(spec)) == (
            ["worker"],
            1,
            ["rank 0", "rank 1"],
            {"worker": ["rank 0", "rank 1"]},
        )
        assert repr(spec) == "ClusterSpec({'worker': ['rank 0', 'rank 1']})"

    def test_cannot_be_changed_through_what_it_returns(self) -> None:
        """Lists and dicts it returns are copies; it has no item assignment."""
        spec = Cluster(worker_index=0, num_workers=2).cluster_spec()
        workers = spec["worker"]
        assert isinstance(workers, list)
        workers.append("rank 9")
        spec.as_dict()["ps"] = ["x"]
        spec.job_tasks("worker").clear()
        spec.jobs.append("ps")
        assert spec == {"worker": ["rank 0", "rank 1"]}
        with pytest.raises(TypeError):
            spec["worker"] = []  # type: ignore[index]

    def test_jobs_sorted_as_tf_sorts_them(self) -> None:
        """Jobs come in name order whatever the order given, as in TF."""
        spec = ClusterSpec({"worker": ["w0"], "chief": ["c0"]})
        assert (spec.jobs, list(spec)) == (["chief", "worker"], ["chief", "worker"])

    @pytest.mark.parametrize(
        ("call", "error", "message"),
        [
            (
                lambda s: s.num_tasks("ps"),
                ValueError,
                "ClusterSpec.num_tasks: no such job in the cluster: 'ps'; its jobs are 'worker'",
            ),
            (lambda s: s.task_indices("ps"), ValueError, "ClusterSpec.task_indices: no such job"),
            (lambda s: s.job_tasks("ps"), ValueError, "ClusterSpec.job_tasks: no such job"),
            (lambda s: s.task_address("ps", 0), ValueError, "ClusterSpec.task_address: no such"),
            (
                lambda s: s.task_address("worker", 2),
                ValueError,
                "ClusterSpec.task_address: no task with index 2 in job 'worker', whose tasks are "
                "0 to 1",
            ),
            (
                lambda s: s.task_address("worker", "1"),
                TypeError,
                "ClusterSpec.task_address: task_index must be an int, got str '1'",
            ),
        ],
    )
    def test_unknown_jobs_and_tasks_are_refused(
        self, call: Any, error: type[Exception], message: str
    ) -> None:
        """An unknown job or task index raises ValueError naming it, as TF's does."""
        spec = Cluster(worker_index=0, num_workers=2).cluster_spec()
        with pytest.raises(error) as caught:
            call(spec)
        assert str(caught.value).startswith(message), caught.value

    @pytest.mark.parametrize(
        "cluster",
        [["rank 0"], {1: ["rank 0"]}, {"worker": "rank 0"}, {"worker": [0]}],
        ids=["a list", "a job not named by str", "tasks as one str", "a task not a str"],
    )
    def test_malformed_clusters_are_refused(self, cluster: Any) -> None:
        """A cluster that is not job names to lists of addresses is a TypeError."""
        with pytest.raises(TypeError, match=r"^ClusterSpec: "):
            ClusterSpec(cluster)


class TestClusterResolver:
    def test_rpc_layer_and_environment(self) -> None:
        """No RPC layer under MPI (None, as TF's resolvers without one), and TF's default
        environment."""
        cluster = Cluster(worker_index=0, num_workers=2)
        assert (cluster.rpc_layer, cluster.environment) == (None, "")

    def test_num_accelerators_refuses_a_task_not_in_the_cluster(self) -> None:
        """num_accelerators(task_type, task_id) names a task of the cluster, as master()
        does: another job or index is a ValueError; one argument alone is ignored."""
        cluster = Cluster(worker_index=0, num_workers=2, gpus=2)
        refused = []
        for task_type, task_id in [("worker", 5), ("ps", 0)]:
            with pytest.raises(ValueError, match=r"^num_accelerators\(\): no ") as info:
                cluster.num_accelerators(task_type, task_id)
            refused.append(str(info.value))
        assert refused == [
            "num_accelerators(): no task with index 5 in job 'worker', whose tasks are 0 to 1",
            "num_accelerators(): no such job in the cluster: 'ps'; its one job is 'worker'",
        ]
        answers = [cluster.num_accelerators("worker", 1), cluster.num_accelerators(None, 5)]
        assert answers == [{"GPU": 2}, {"GPU": 2}]


class TestSparseJobs:
    def test_reads_as_tfs(self) -> None:
        """A job given as {task index: address} reads as TF's sparse job: as_dict keeps the
        dict, num_tasks counts the tasks given, job_tasks fills the gaps with None."""
        spec = ClusterSpec({"worker": {3: "w3:2222", 1: "w1:2222"}, "ps": ["p0:2222", "p1:2222"]})
        answers = [
            spec.as_dict(),
            spec["worker"],
            spec.num_tasks("worker"),
            spec.task_indices("worker"),
            spec.task_address("worker", 3),
            spec.job_tasks("worker"),
            repr(spec),
        ]
        assert answers == [
            {"ps": ["p0:2222", "p1:2222"], "worker": {1: "w1:2222", 3: "w3:2222"}},
            {1: "w1:2222", 3: "w3:2222"},
            2,
            [1, 3],
            "w3:2222",
            [None, "w1:2222", None, "w3:2222"],
            "ClusterSpec({'ps': ['p0:2222', 'p1:2222'], 'worker': {1: 'w1:2222', 3: 'w3:2222'}})",
        ]

    def test_dense_indices_read_as_a_list(self) -> None:
        """A mapping whose indices are 0 to n - 1 is the same job as the list, as in TF."""
        spec = ClusterSpec({"worker": {1: "w1", 0: "w0"}})
        assert spec == {"worker": ["w0", "w1"]}
        assert spec.as_dict() == {"worker": ["w0", "w1"]}
        assert ClusterSpec(spec) == spec

    def test_indices_as_json_keys(self) -> None:
        """A spec read from JSON, whose keys are strings, takes them as task indices, as TF's
        int(i) does."""
        spec = ClusterSpec(json.loads('{"worker": {"3": "w3", "1": "w1"}, "ps": ["p0"]}'))
        answers = [spec.as_dict(), spec.task_indices("worker"), spec.task_address("worker", 3)]
        assert answers == [{"ps": ["p0"], "worker": {1: "w1", 3: "w3"}}, [1, 3], "w3"]

    def test_job_without_tasks(self) -> None:
        """A job without tasks reads back as it was given, so the spec equals that dict;
        as_dict shows it as {}, as TF's does."""
        listed, mapped = ClusterSpec({"worker": []}), ClusterSpec({"worker": {}})
        answers = [listed["worker"], mapped["worker"], listed.as_dict(), mapped.as_dict()]
        assert answers == [[], {}, {"worker": {}}, {"worker": {}}]
        assert (listed == {"worker": []}, mapped == {"worker": {}}) == (True, True)
        assert (listed.num_tasks("worker"), listed.job_tasks("worker")) == (0, [])
        assert ClusterSpec(listed) == listed

    def test_equal_however_the_tasks_are_written(self) -> None:
        """Two specs of the same jobs and tasks are equal, and equal to the dicts that make
        them, whether a job's tasks are a list or a mapping: a spec equals the one rebuilt
        from its own as_dict(), repr or JSON."""
        spec = ClusterSpec({"ps": [], "worker": ["w0", "w1"]})
        dense = {"ps": {}, "worker": {0: "w0", 1: "w1"}}
        rebuilt = [
            ClusterSpec(spec.as_dict()),
            ClusterSpec(json.loads(json.dumps(spec.as_dict()))),
            eval(repr(spec), {"ClusterSpec": ClusterSpec}),
            ClusterSpec(dense),
        ]
        assert [other == spec for other in rebuilt] == [True] * 4
        assert (spec == dense, ClusterSpec(dense) == dense) == (True, True)
        others = [{"ps": [], "worker": ["w0"]}, {"worker": ["w0", "w1"]}, {"ps": 1}, [], "ps"]
        assert [spec == other for other in others] == [False] * 5

    def test_missing_task_is_refused_naming_the_tasks(self) -> None:
        """task_address of an index the sparse job does not give is a ValueError listing the
        indices it has."""
        spec = ClusterSpec({"worker": {1: "w1", 3: "w3"}})
        with pytest.raises(ValueError, match=r"^ClusterSpec.task_address: no task ") as info:
            spec.task_address("worker", 0)
        assert str(info.value) == (
            "ClusterSpec.task_address: no task with index 0 in job 'worker', whose tasks are 1, 3"
        )

    @pytest.mark.parametrize(
        ("tasks", "error", "message"),
        [
            ({1.0: "w1"}, TypeError, "ClusterSpec: job 'worker' must have a sequence of task"),
            ({1: 2222}, TypeError, "ClusterSpec: job 'worker' must have a sequence of task"),
            (
                {-1: "w"},
                ValueError,
                "ClusterSpec: job 'worker' has a task with index -1; task indices are ints >= 0",
            ),
            (
                {"-1": "w"},
                ValueError,
                "ClusterSpec: job 'worker' has a task with index '-1'; task indices are ints >= "
                "0, or strings of their digits (as JSON keys)",
            ),
            (
                {"one": "w"},
                ValueError,
                "ClusterSpec: job 'worker' has a task with index 'one'; task indices are ints >= "
                "0, or strings of their digits (as JSON keys)",
            ),
            (
                {1: "w1", "01": "w1b"},
                ValueError,
                "ClusterSpec: job 'worker' gives task 1 twice, as 1 and '01'; give each task "
                "index once",
            ),
        ],
        ids=[
            "an index not an int",
            "an address not a str",
            "a negative index",
            "a negative index as str",
            "an index str not digits",
            "an index given twice",
        ],
    )
    def test_malformed_sparse_jobs_are_refused(
        self, tasks: Any, error: type[Exception], message: str
    ) -> None:
        """Task indices are ints >= 0 and addresses str."""
        with pytest.raises(error) as info:
            ClusterSpec({"worker": tasks})
        assert str(info.value).startswith(message), info.value
