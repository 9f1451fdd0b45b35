"""KServe v2 over gRPC with the real `tritonclient.grpc` (and its generated stub, for what the
high-level client does not expose): health, metadata, raw and typed tensors, BYTES, streaming,
keys, errors as gRPC codes with their retry metadata, and deadlines."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from sluice.gateway.tenants import hash_key, new_key
from sluice.repository import demo_repository
from tests.conftest import ServerProcess, eventually, free_port, start_server, write_emulated_model

pytestmark = pytest.mark.slow

KEYS = {name: new_key() for name in ("alpha", "beta", "tiny")}
ADMIN_KEY = new_key()
TENANTS = f"""
[admin]
api_keys = ["{hash_key(ADMIN_KEY)}"]

[tenants.alpha]
api_keys = ["{hash_key(KEYS['alpha'])}"]

[tenants.beta]
api_keys = ["{hash_key(KEYS['beta'])}"]
models = ["emulated"]

[tenants.tiny]
api_keys = ["{hash_key(KEYS['tiny'])}"]
requests_per_min = 2
"""


def auth(tenant: str = "alpha") -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    repo = tmp_path_factory.mktemp("repo")
    write_emulated_model(repo, "emulated", slo_ms=30000)
    write_emulated_model(repo, "slow", alpha_ms=400, beta_ms=0.0, max_batch_size=1, slo_ms=30000)
    write_emulated_model(repo, "tight", alpha_ms=150, beta_ms=0.0, max_batch_size=1, slo_ms=400)
    shutil.copytree(demo_repository() / "minilm", repo / "minilm")
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    grpc_port = free_port()
    started = start_server(repo, tmp_path_factory.mktemp("log"), "--tenants", str(tenants),
                           "--grpc-port", str(grpc_port))
    yield started, grpc_port
    started.stop()


@pytest.fixture(scope="module")
def client(server) -> Iterator[triton.InferenceServerClient]:
    sdk = triton.InferenceServerClient(f"127.0.0.1:{server[1]}")
    yield sdk
    sdk.close()


@pytest.fixture(scope="module")
def stub(server) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server[1]}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def rows(num_rows: int = 4, length: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((num_rows, length)).astype(np.float32)


def fp32_input(array: np.ndarray, name: str = "INPUT0") -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def raw_request(model: str, array: np.ndarray, **fields) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(array.shape))
    request.raw_input_contents.append(array.astype("<f4").tobytes())
    return request


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    return caught.value


def test_health_needs_no_key_and_metadata_describes_the_models(client, server):
    import httpx

    assert client.is_server_live()
    assert client.is_server_ready()
    assert {"binary_tensor_data", "classification"} <= set(client.get_server_metadata(headers=auth()).extensions)
    for headers, status, code in (({}, 401, "StatusCode.UNAUTHENTICATED"),
                                  ({"authorization": f"Bearer {ADMIN_KEY}"}, 403, "StatusCode.PERMISSION_DENIED")):
        assert httpx.get(f"{server[0].url}/v2", headers=headers).status_code == status  # as over HTTP
        with pytest.raises(InferenceServerException) as caught:
            client.get_server_metadata(headers=headers)
        assert caught.value.status() == code
    assert client.is_model_ready("emulated", headers=auth())
    assert client.is_model_ready("minilm", model_version="1", headers=auth())
    emulated = client.get_model_metadata("emulated", headers=auth())
    assert (emulated.name, list(emulated.versions), emulated.platform) == ("emulated", ["1"], "sluice_emulated")
    assert [(t.name, t.datatype, list(t.shape)) for t in emulated.inputs] == [("INPUT0", "FP32", [-1, -1])]
    minilm = client.get_model_metadata("minilm", headers=auth())
    assert [(t.name, t.datatype, list(t.shape)) for t in minilm.outputs] == [("embedding", "FP32", [-1, 384])]


def test_infer_with_raw_tensors_as_tritonclient_sends_them(client):
    x = rows()
    result = client.infer("emulated", [fp32_input(x)], request_id="req-7", headers=auth())
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x.sum(axis=1), rtol=1e-5)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("emulated", "1", "req-7")
    assert len(response.raw_output_contents) == 1  # where tritonclient reads outputs


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_from_tritonclient_is_answered(client, algorithm):
    """tritonclient's `compression_algorithm` compresses the message: grpcio's server takes it as
    it is (no server option needed)."""
    x = rows(64, 256)
    result = client.infer("emulated", [fp32_input(x)], headers=auth(), compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x.sum(axis=1), rtol=1e-4)


def test_a_message_that_decompresses_past_the_limit_is_refused(stub):
    """The message limit (the HTTP body limit, 32 MiB) holds for what a compressed message inflates
    to: 40 MiB of zeros, ~40 KB once gzipped, is refused by gRPC itself."""
    request = raw_request("emulated", np.zeros((1, 10 << 20), np.float32))
    error = rpc_error(stub.ModelInfer, request, metadata=tuple(auth().items()), timeout=60,
                      compression=grpc.Compression.Gzip)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in error.details()


def test_infer_with_typed_contents(stub):
    x = rows(3, seed=1)
    request = service_pb2.ModelInferRequest(model_name="emulated", id="typed")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[3, 16])
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    response, call = stub.ModelInfer.with_call(request, metadata=tuple(auth().items()))
    np.testing.assert_allclose(np.frombuffer(response.raw_output_contents[0], "<f4"), x.sum(axis=1), rtol=1e-5)
    assert list(response.outputs[0].shape) == [3]
    trailing = dict(call.trailing_metadata())
    assert trailing["x-request-id"]


def test_bytes_input_embeds_like_the_http_api(client, server):
    import httpx

    texts = [b"hello world", b"the queue drains"]
    tensor = triton.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object))
    vectors = client.infer("minilm", [tensor], headers=auth(), timeout=30_000_000).as_numpy("embedding")  # roomy
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-4)
    answer = httpx.post(f"{server[0].url}/v1/embeddings", headers=auth(), timeout=60,
                        json={"model": "minilm", "input": [t.decode() for t in texts]})
    http_vectors = np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(vectors, http_vectors, atol=1e-5)


def test_classification_answers_each_rows_top_classes_in_raw_output(client, stub):
    """Triton's classification extension over gRPC: `class_count=2` turns each row's embedding
    into its two highest `"value:index"` entries, a BYTES output read from `raw_output_contents`."""
    tensor = triton.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([b"the queue drains", b"a cat naps"], dtype=object))
    roomy = 30_000_000  # microseconds: a loaded test machine must not turn minilm's 500 ms SLO into a 504
    vectors = client.infer("minilm", [tensor], headers=auth(), timeout=roomy).as_numpy("embedding")
    result = client.infer("minilm", [tensor], outputs=[triton.InferRequestedOutput("embedding", class_count=2)],
                          headers=auth(), timeout=roomy)
    assert result.get_output("embedding").datatype == "BYTES"
    classes = result.as_numpy("embedding")
    assert classes.shape == (2, 2)
    for row, got in zip(vectors, classes, strict=True):
        top = sorted(range(len(row)), key=lambda i: (-row[i], i))[:2]
        assert [int(entry.decode().split(":")[1]) for entry in got] == top
        assert [float(entry.decode().split(":")[0]) for entry in got] == pytest.approx(row[top].tolist(), abs=1e-6)
    request = raw_request("emulated", rows(2))
    request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = -1
    error = rpc_error(stub.ModelInfer, request, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "classification" in error.details()


def test_a_stream_answers_every_request_by_id_and_fails_only_the_bad_one(client):
    results: dict[str, np.ndarray] = {}
    errors: list[str] = []
    done = threading.Event()
    lock = threading.Lock()

    def on_answer(result, error):
        with lock:
            if error is not None:
                errors.append(error.message())
            else:
                results[result.get_response().id] = result.as_numpy("OUTPUT0")
            if len(results) + len(errors) == 21:
                done.set()

    inputs = {f"s{i}": rows(2, seed=i) for i in range(20)}
    client.start_stream(on_answer, headers=auth())
    try:
        for i, (request_id, x) in enumerate(inputs.items()):
            client.async_stream_infer("emulated", [fp32_input(x)], request_id=request_id)
            if i == 10:
                client.async_stream_infer("emulated", [fp32_input(x, name="WRONG")], request_id="bad")
        assert done.wait(60), f"{len(results)} answers and {len(errors)} errors after 60 s"
    finally:
        client.stop_stream()
    assert sorted(results) == sorted(inputs)
    for request_id, x in inputs.items():
        np.testing.assert_allclose(results[request_id], x.sum(axis=1), rtol=1e-5)
    assert len(errors) == 1 and "INPUT0" in errors[0] and errors[0].startswith("request 'bad': ")


def test_a_failed_request_on_a_raw_stream_is_answered_by_id_and_final(stub):
    request = raw_request("emulated", rows(1), id="bad")
    request.inputs[0].name = "WRONG"
    (answer,) = stub.ModelStreamInfer(iter([request]), metadata=tuple(auth().items()), timeout=30)
    assert answer.error_message.startswith("request 'bad': ") and answer.infer_response.id == "bad"
    assert answer.infer_response.parameters["triton_final_response"].bool_param
    assert answer.infer_response.model_version == "1", "the version that was chosen, as a success names"


def test_keys_are_required_and_models_are_scoped(client, stub):
    x = rows(1)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("emulated", [fp32_input(x)])
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as caught:
        client.infer("emulated", [fp32_input(x)], headers={"authorization": "Bearer sk-not-a-key"})
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.infer("emulated", [fp32_input(x)], headers=auth("beta")).as_numpy("OUTPUT0").shape == (1,)
    error = rpc_error(stub.ModelMetadata, service_pb2.ModelMetadataRequest(name="slow"),
                      metadata=tuple(auth("beta").items()))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    error = rpc_error(stub.ModelInfer, raw_request("slow", x), metadata=tuple(auth("beta").items()))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


def test_tritons_configuration_statistics_and_index_over_grpc_for_the_callers_models(client, stub):
    """tritonclient.grpc decodes sluice's answers with Triton's own classes."""
    extensions = set(client.get_server_metadata(headers=auth()).extensions)
    assert {"model_configuration", "statistics", "model_repository", "schedule_policy"} <= extensions
    config = client.get_model_config("slow", headers=auth()).config
    assert (config.name, config.max_batch_size, config.backend) == ("slow", 1, "emulated")
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("INPUT0", model_config_pb2.TYPE_FP32, [-1])]
    assert config.dynamic_batching.default_queue_policy.default_timeout_microseconds == 30_000_000
    assert config.dynamic_batching.priority_levels == 3
    assert client.get_model_config("minilm", headers=auth(), as_json=True)["config"]["output"][0]["dims"] == ["384"]

    before = client.get_inference_statistics("emulated", headers=auth("beta")).model_stats[0]
    client.infer("emulated", [fp32_input(rows(3, seed=77))], headers=auth("beta"))
    (after,) = client.get_inference_statistics("emulated", "1", headers=auth("beta")).model_stats
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1
    assert after.inference_count == before.inference_count + 3
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    visible = {(s.name, s.version) for s in client.get_inference_statistics(headers=auth("beta")).model_stats}
    assert visible == {("emulated", "1")}  # beta may use emulated only
    assert {m.name for m in client.get_model_repository_index(headers=auth("beta")).models} == {"emulated"}
    assert {m.name for m in client.get_model_repository_index(headers=auth()).models} >= {"emulated", "slow", "minilm"}

    for call, request in ((stub.ModelConfig, service_pb2.ModelConfigRequest(name="slow")),
                          (stub.ModelStatistics, service_pb2.ModelStatisticsRequest(name="slow"))):
        error = rpc_error(call, request, metadata=tuple(auth("beta").items()))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert rpc_error(call, request).code() == grpc.StatusCode.UNAUTHENTICATED
    error = rpc_error(stub.RepositoryModelUnload, service_pb2.RepositoryModelUnloadRequest(model_name="slow"),
                      metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "admin key" in error.details()
    assert rpc_error(stub.RepositoryModelLoad, service_pb2.RepositoryModelLoadRequest(model_name="slow")).code() \
        == grpc.StatusCode.UNAUTHENTICATED


def test_the_admin_loads_models_over_grpc(client):
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    client.load_model("slow", headers=admin)  # the repository has not changed: nothing to do
    assert client.is_model_ready("slow", headers=auth())
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("no-such-model", headers=admin)
    assert caught.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_admin_who_loads_models_reads_every_models_index_and_statistics(server, protocol):
    """README: admin keys load and unload models and read the model statistics: with `/metrics`
    open (no `[metrics]` section) too, and the repository index of what they load, every model's."""
    import tritonclient.http as triton_http

    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    sdk = triton.InferenceServerClient(f"127.0.0.1:{server[1]}") if protocol == "grpc" else \
        triton_http.InferenceServerClient(server[0].url.removeprefix("http://"))
    try:
        index = sdk.get_model_repository_index(headers=admin)
        names = {m.name for m in index.models} if protocol == "grpc" else {m["name"] for m in index}
        assert names == {"emulated", "slow", "tight", "minilm"}  # beta's key sees emulated alone
        statistics = sdk.get_inference_statistics(headers=admin)
        stats = statistics.model_stats if protocol == "grpc" else statistics["model_stats"]
        seen = {s.name for s in stats} if protocol == "grpc" else {s["name"] for s in stats}
        assert seen >= {"emulated", "slow", "tight", "minilm"}
        one = sdk.get_inference_statistics("slow", headers=admin)
        assert len(one.model_stats if protocol == "grpc" else one["model_stats"]) == 1
    finally:
        sdk.close()


def test_a_rate_limited_tenant_gets_resource_exhausted_with_retry_metadata(stub):
    metadata = tuple(auth("tiny").items())
    codes = []
    for _ in range(4):
        try:
            stub.ModelInfer(raw_request("emulated", rows(1)), metadata=metadata)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            codes.append(error.code())
            refused = error
    assert codes[:2] == [grpc.StatusCode.OK] * 2 and codes[2:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    trailing = dict(refused.trailing_metadata())
    assert int(trailing["retry-after"]) >= 1 and int(trailing["retry-after-ms"]) >= 1
    assert trailing["x-sluice-limit"] == "requests"
    assert "x-ratelimit-limit-requests" in trailing


@pytest.mark.parametrize(("change", "words"), [
    (lambda r: r.inputs[0].__setattr__("name", "WRONG"), "INPUT0"),
    (lambda r: r.raw_input_contents.append(b"\0" * 4), "raw_input_contents"),
    (lambda r: r.outputs.add(name="NOPE"), "NOPE"),
    (lambda r: (r.outputs.add(name="OUTPUT0"), r.outputs.add(name="OUTPUT0")), "requested more than once"),
    (lambda r: r.parameters["timeout"].__setattr__("int64_param", -5), "timeout"),
    (lambda r: r.parameters["priority"].__setattr__("string_param", "urgent"), "priority"),
    (lambda r: r.inputs[0].__setattr__("datatype", "FP64"), "bytes do not match"),
    (lambda r: (r.inputs[0].__setattr__("datatype", "FP64"),
                r.raw_input_contents.__setitem__(0, np.zeros(32, "<f8").tobytes())), "must be FP32"),
    (lambda r: r.inputs[0].shape.__setitem__(0, 7), "shape"),
])
def test_malformed_requests_are_invalid_argument(stub, change, words):
    request = raw_request("emulated", rows(2))
    change(request)
    error = rpc_error(stub.ModelInfer, request, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert words in error.details()


def test_typed_contents_that_do_not_fit_are_invalid_argument(stub):
    request = service_pb2.ModelInferRequest(model_name="emulated")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16]).contents.fp32_contents.extend([1.0] * 5)
    error = rpc_error(stub.ModelInfer, request, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fill" in error.details()
    ints = service_pb2.ModelInferRequest(model_name="emulated")
    ints.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16]).contents.int_contents.extend([1] * 32)
    error = rpc_error(stub.ModelInfer, ints, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "go in contents.fp32_contents" in error.details()
    both = raw_request("emulated", rows(2))
    both.inputs[0].contents.fp32_contents.extend([0.0] * 32)  # which of the two is meant?
    error = rpc_error(stub.ModelInfer, both, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "both in raw_input_contents" in error.details()
    half = service_pb2.ModelInferRequest(model_name="emulated")
    half.inputs.add(name="INPUT0", datatype="FP16", shape=[1, 16])
    error = rpc_error(stub.ModelInfer, half, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in error.details()


@pytest.mark.parametrize("call", [
    lambda c: c.get_system_shared_memory_status(headers=auth()),
    lambda c: c.register_system_shared_memory("region", "/sluice-test", 64, headers=auth()),
    lambda c: c.unregister_cuda_shared_memory(headers=auth()),
    lambda c: c.get_trace_settings(headers=auth()),
    lambda c: c.update_log_settings({"log_verbose_level": 1}, headers=auth()),
])
def test_an_extension_sluice_does_not_offer_is_unimplemented_saying_why(client, call):
    with pytest.raises(InferenceServerException) as caught:
        call(client)
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "sluice does not support Triton's" in caught.value.message()  # not gRPC's bare "Method not found!"


def test_tensors_in_shared_memory_are_unimplemented(stub):
    request = service_pb2.ModelInferRequest(model_name="emulated")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16])
    tensor.parameters["shared_memory_region"].string_param = "region"
    tensor.parameters["shared_memory_byte_size"].int64_param = 128
    error = rpc_error(stub.ModelInfer, request, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED and "shared memory" in error.details()
    request = raw_request("emulated", rows(2))
    request.outputs.add(name="OUTPUT0").parameters["shared_memory_region"].string_param = "region"
    error = rpc_error(stub.ModelInfer, request, metadata=tuple(auth().items()))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED and "output 'OUTPUT0'" in error.details()


def test_unknown_models_are_not_found(client, stub):
    with pytest.raises(InferenceServerException) as caught:
        client.infer("no-such-model", [fp32_input(rows(1))], headers=auth())
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_model_ready_is_false_not_an_error_for_unknown_and_unloaded_models(client, stub):
    """As Triton's gRPC and the HTTP `is_model_ready`: `ready: false`, status OK."""
    assert not client.is_model_ready("no-such-model", headers=auth())
    assert not client.is_model_ready("emulated", model_version="9", headers=auth())
    assert not stub.ModelReady(service_pb2.ModelReadyRequest(name="emulated", version="9"),
                               metadata=tuple(auth().items())).ready
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    client.unload_model("tight", headers=admin)
    try:
        assert not client.is_model_ready("tight", headers=auth())
    finally:
        client.load_model("tight", headers=admin)
    assert client.is_model_ready("tight", headers=auth())
    assert rpc_error(stub.ModelReady, service_pb2.ModelReadyRequest(name="no-such-model")).code() \
        == grpc.StatusCode.UNAUTHENTICATED
    error = rpc_error(stub.ModelReady, service_pb2.ModelReadyRequest(name="slow"), metadata=tuple(auth("beta").items()))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_timeout_parameter_and_the_calls_deadline_bound_the_request(client):
    x = rows(1)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as caught:  # the server's 504: 400 ms of work, 100 ms allowed
        client.infer("slow", [fp32_input(x)], timeout=100_000, headers=auth())
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "deadline" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:  # the client's own gRPC deadline
        client.infer("slow", [fp32_input(x)], client_timeout=0.1, headers=auth())
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 5
    assert client.infer("slow", [fp32_input(x)], client_timeout=20, headers=auth()).as_numpy("OUTPUT0").shape == (1,)


def test_overload_is_unavailable_with_retry_metadata(stub):
    """`tight` runs one 150 ms item at a time within a 400 ms deadline: of 12 sent at once, the
    ones that could not finish in time are refused at once, with when to retry."""
    metadata = tuple(auth().items())
    calls = [stub.ModelInfer.future(raw_request("tight", rows(1, seed=i)), metadata=metadata) for i in range(12)]
    outcomes = []
    for call in calls:
        try:
            call.result(timeout=30)
            outcomes.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            outcomes.append(error.code())
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                trailing = dict(error.trailing_metadata())
                assert int(trailing["retry-after-ms"]) >= 1 and trailing["x-request-id"]
    assert outcomes.count(grpc.StatusCode.OK) >= 1
    assert outcomes.count(grpc.StatusCode.UNAVAILABLE) >= 4, outcomes
    assert set(outcomes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def test_the_clients_request_id_comes_back(stub):
    _, call = stub.ModelInfer.with_call(raw_request("emulated", rows(1)),
                                        metadata=(*auth().items(), ("x-request-id", "trace-me-42")))
    assert dict(call.trailing_metadata())["x-request-id"] == "trace-me-42"


def test_the_banner_names_the_grpc_address(server):
    eventually(lambda: f"KServe v2 over gRPC on 127.0.0.1:{server[1]}" in server[0].log(), "the banner")


def test_a_grpc_port_in_use_stops_the_start(tmp_path: Path):
    import socket

    repo = write_emulated_model(tmp_path / "repo")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="gRPC"):
            start_server(repo, tmp_path, "--grpc-port", str(taken.getsockname()[1]), ready_timeout_s=60)
