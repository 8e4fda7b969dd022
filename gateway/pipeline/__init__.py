"""The async layers a proxied request passes through, composed in `chain.py`."""
