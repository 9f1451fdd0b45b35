"""`examples/models` serves as its README says: the curl request it shows gets the answer it
shows, and `tritonclient` gets the same."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import start_server

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_churn_example_answers_as_its_readme_shows(tmp_path: Path):
    readme = (EXAMPLES / "README.md").read_text()
    body = re.search(r"-d '(.*?)'", readme, re.S).group(1)  # the documented request, as sent
    server = start_server(EXAMPLES / "models", tmp_path)
    try:
        answer = httpx.post(f"{server.url}/v2/models/churn/infer", content=body, timeout=30)
        assert answer.status_code == 200, answer.text
        outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
        assert outputs["label"] == ["churn", "stay"]  # as the README's answer shows
        assert outputs["probability"][0] > 0.9 > 0.1 > outputs["probability"][1]
        with triton.InferenceServerClient(url=f"127.0.0.1:{server.port}") as client:
            features = triton.InferInput("features", [2, 4], "FP32")
            features.set_data_from_numpy(np.array([[3, 95, 4, 0], [48, 40, 0, 2]], dtype=np.float32))
            result = client.infer("churn", [features])
            assert result.as_numpy("label").tolist() == [b"churn", b"stay"]
            np.testing.assert_allclose(result.as_numpy("probability"), outputs["probability"], rtol=1e-6)
            features.set_data_from_numpy(np.array([[3, 95, 4, 0], [1, 2, 3, np.nan]], dtype=np.float32))
            with pytest.raises(InferenceServerException) as refused:  # its NaN row fails, in the model's words
                client.infer("churn", [features])
        assert refused.value.status() == "422" and "features must be finite numbers" in refused.value.message()
    finally:
        server.stop()
