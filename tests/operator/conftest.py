"""The operator tests' clusters: the API server double with the real operator (kopf over HTTP) beside it, from
tests/kube/operator_cluster.py (where the tests that start the operator elsewhere, test_client and test_job_policy,
take them from too)."""
from kube.operator_cluster import cluster, labelled_cluster, own_cluster, shared_cluster

__all__ = ["cluster", "labelled_cluster", "own_cluster", "shared_cluster"]
