"""Accuracy kept under pruning, over a dataset (`vlmprune eval --dataset`).

The sweep's machinery, below the model: a dataset of (image, question, answers) samples
(dataset), exact match and bootstrap intervals (stats), a store of finished cells keyed by
what decides them (store), and executors that run cells in this process or on a Ray
cluster (executors). What answers a cell, a compiled bundle with its model's language
model, is the caller's (compiler.evaluate.BundleWorker): imports here run down to the
pipeline, never up to generate or the API.
"""
