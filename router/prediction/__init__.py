"""Predict-on-route: what a just-routed request will leave cached, and KV pressure."""
