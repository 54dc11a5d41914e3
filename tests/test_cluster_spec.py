"""The cluster resolver's cluster spec, as TF's ``tf.train.ClusterSpec`` reads."""

from __future__ import annotations

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
        spec["worker"].append("rank 9")
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
