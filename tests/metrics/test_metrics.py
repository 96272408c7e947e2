"""The Prometheus exporter over real HTTP, and the naming conventions."""
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from hybridflow.metrics import STAGES, JobMetrics


def _record(step):
    return {
        "step": step, "tokens": 1000.0, "throughput_tokens_per_s": 500.0, "throughput_per_device": 250.0,
        "generation_tokens_per_s": 800.0, "iteration_seconds": 2.0, "eta_seconds": 10.0, "reward_mean": 0.5,
        "response_length_mean": 6.0, "kl_mean": 0.01, "entropy_mean": 2.0, "clip_frac": 0.1, "grad_norm": 1.5,
        "actor_peak_memory_bytes": 1e9, "reshard_bytes": 4096.0,
    }


def test_exporter_serves_step_metrics_over_http():
    m = JobMetrics("tiny")
    port = m.serve(0, "127.0.0.1")
    m.record_step(_record(1), {s: 0.1 for s in STAGES})
    m.record_step(_record(2), {"generate": 0.5})
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(body) for s in fam.samples}
    assert samples[("hybridflow_step", (("rlhfjob", "tiny"),))] == 2
    assert samples[("hybridflow_tokens_total", (("rlhfjob", "tiny"),))] == 2000
    assert samples[("hybridflow_throughput_tokens_per_second", (("rlhfjob", "tiny"),))] == 500
    assert samples[("hybridflow_stage_duration_seconds", (("rlhfjob", "tiny"), ("stage", "generate")))] == 0.5
    assert samples[("hybridflow_stage_seconds_total", (("rlhfjob", "tiny"), ("stage", "generate")))] == 0.6
    assert samples[("hybridflow_peak_memory_bytes", (("rlhfjob", "tiny"), ("role", "actor")))] == 1e9
    assert samples[("hybridflow_reward_mean", (("rlhfjob", "tiny"),))] == 0.5


def test_naming_conventions():
    m = JobMetrics("tiny")
    m.record_step(_record(1), {s: 0.1 for s in STAGES})
    for fam in m.registry.collect():
        assert fam.name.startswith("hybridflow_"), fam.name
        for s in fam.samples:
            assert "job" not in s.labels, f"{s.name} uses the label 'job', which Prometheus owns"
            assert set(s.labels) <= {"rlhfjob", "stage", "role", "phase", "le"}, s.labels
        if re.search(r"(seconds|time)", fam.name):
            assert "seconds" in fam.name


def test_exposition_suffixes_match_metric_types():
    """What Prometheus sees: counters end in `_total`, and nothing else does (a gauge named `..._total` reads as
    a counter to `rate()` users); histogram series come only from histograms."""
    from prometheus_client import generate_latest

    m = JobMetrics("tiny")
    m.record_step(_record(1), {s: 0.1 for s in STAGES})
    text = generate_latest(m.registry).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert "counter" in types.values() and "gauge" in types.values(), types
    for name, kind in types.items():
        assert name.endswith("_total") == (kind == "counter"), f"{name} is a {kind}"
        series = set(re.findall(rf"^({re.escape(name)}\w*)[{{ ]", text, re.M))
        if kind != "histogram":
            assert not any(x.endswith(("_bucket", "_count", "_sum")) for x in series), (name, series)
