"""A logistic-regression churn classifier: the smallest useful `python` model.

Each row of `features` is (tenure in months, monthly charge, support calls, contract years);
the answer is the probability that the customer leaves and a label at `params["threshold"]`.
"""

import json

import numpy as np


class Model:
    def __init__(self, path, device, params):
        weights = json.loads((path / "weights.json").read_text())
        self.mean = np.asarray(weights["mean"], dtype=np.float32)
        self.scale = np.asarray(weights["scale"], dtype=np.float32)
        self.coef = np.asarray(weights["coef"], dtype=np.float32)
        self.bias = np.float32(weights["bias"])
        self.threshold = float(params.get("threshold", 0.5))

    def predict(self, inputs):
        features = inputs["features"]  # [batch, 4]: the rows of every request in this batch
        if not np.isfinite(features).all():
            raise ValueError("features must be finite numbers")
        logits = ((features - self.mean) / self.scale) @ self.coef + self.bias
        probability = 1 / (1 + np.exp(-logits))
        label = np.where(probability >= self.threshold, "churn", "stay")
        return {"probability": probability.astype(np.float32), "label": label.tolist()}
