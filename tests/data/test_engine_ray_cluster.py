"""engine: ray on a two-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster, 1 CPU per node):
the whole example pipeline gives the bytes of engine: local, with work placed on both nodes."""
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -r requirements-ray.txt)")
pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]

from data import merge, tokenize  # noqa: E402
from tests.data.test_engine_ray import assert_same_outputs, fault_hooks, run_local_then_ray  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head and a worker node of 1 CPU each, joined by this process; torn down at the end. Yields the
    directory where the tokenize workers name their node (tests.data.test_engine_ray.fault_hooks)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process; this module starts its own cluster")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        marks = tmp_path_factory.mktemp("nodes")
        ray.init(address=cluster.address, runtime_env={"worker_process_setup_hook": fault_hooks(marks)})
        yield marks
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_two_node_cluster_output_is_byte_identical_to_local(two_nodes, tmp_path, monkeypatch):
    """Small byte ranges (16 kB, ~14 of merged.jsonl) so that tokenize has tasks for both nodes."""
    monkeypatch.setattr(tokenize, "RANGE_BYTES", 16_000)
    monkeypatch.setattr(merge, "MERGE_RANGE_BYTES", 16_000)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    local_dir, ray_dir = run_local_then_ray(tmp_path, "num_workers=0")  # 0: every CPU of the cluster (2)
    assert_same_outputs(local_dir, ray_dir)
    assert len(list(two_nodes.glob("node-*"))) == 2, "tokenize did not run on both nodes"
