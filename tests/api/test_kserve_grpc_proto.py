"""The gRPC service sluice serves is the one clients were generated from: every request and response
message and every method of `proto/grpc_predict_v2.proto` matches Triton's `grpc_service.proto`
(as shipped in tritonclient) field for field; the parts of Triton's `model_config.proto` it holds
are Triton's fields with Triton's numbers; and the descriptor set sluice loads is the .proto
compiled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2

import sluice.api.kserve_grpc as kserve_grpc

PROTO_DIR = Path(kserve_grpc.__file__).parent / "proto"


def _fields(descriptor) -> dict[str, tuple]:
    """Every field, nested messages included, by its full path: what decides the wire format."""
    fields = {}
    for field in descriptor.fields:
        target = field.message_type.full_name if field.message_type is not None else None
        fields[f"{descriptor.name}.{field.name}"] = (field.number, field.type, field.label, target,
                                                     field.containing_oneof.name if field.containing_oneof else None)
    for nested in descriptor.nested_types:
        fields |= {f"{descriptor.name}.{name}": value for name, value in _fields(nested).items()}
    return fields


def test_every_message_matches_tritons_field_for_field():
    for name, message in kserve_grpc.MESSAGES.items():
        ours = message.DESCRIPTOR
        theirs = service_pb2.DESCRIPTOR.message_types_by_name[name]
        assert ours.full_name == theirs.full_name == f"inference.{name}"
        assert _fields(ours) == _fields(theirs), name


def _tritons(name: str):
    for file in (service_pb2.DESCRIPTOR, model_config_pb2.DESCRIPTOR):
        if name in file.message_types_by_name:
            return file.message_types_by_name[name]
        if name in file.enum_types_by_name:
            return file.enum_types_by_name[name]
    raise AssertionError(f"Triton has no {name}")


def _values(enum) -> dict[str, int]:
    return {value.name: value.number for value in enum.values}


def test_every_message_and_enum_of_the_file_is_a_part_of_tritons():
    """Configuration messages hold a subset of Triton's fields (what sluice fills in), each with
    Triton's number, type and target, so that Triton's classes decode what sluice sends."""
    file = kserve_grpc.MESSAGES["ModelConfigResponse"].DESCRIPTOR.file
    assert "ModelConfig" in file.message_types_by_name
    for name, ours in file.message_types_by_name.items():
        theirs = _fields(_tritons(name))
        assert _fields(ours).items() <= theirs.items(), name
        for enum in ours.enum_types:
            assert _values(enum) == _values(_tritons(name).enum_types_by_name[enum.name]), f"{name}.{enum.name}"
    for name, enum in file.enum_types_by_name.items():
        assert _values(enum) == _values(_tritons(name)), name


def test_every_method_is_tritons_with_the_same_types():
    ours = kserve_grpc.MESSAGES["ModelInferRequest"].DESCRIPTOR.file.services_by_name["GRPCInferenceService"]
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == kserve_grpc.SERVICE
    for method in ours.methods:
        twin = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == \
               (twin.input_type.full_name, twin.output_type.full_name)
        assert (method.client_streaming, method.server_streaming) == (twin.client_streaming, twin.server_streaming)


def test_the_descriptor_set_is_the_proto_compiled(tmp_path: Path):
    out = tmp_path / "compiled.binpb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={out}",
                    str(PROTO_DIR / "grpc_predict_v2.proto")], check=True)
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    shipped = descriptor_pb2.FileDescriptorSet.FromString((PROTO_DIR / "grpc_predict_v2.binpb").read_bytes())
    assert compiled == shipped, "run scripts/gen-proto after changing the .proto"
