"""Deployment settings that live next to the code: per-stage Kubernetes pods (`k8s.py`).

The images, the Helm values and their guide are in `deploy/` at the top of the checkout.
"""
