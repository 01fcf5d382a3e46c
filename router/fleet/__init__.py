"""The fleet: instances and their health, served models, admission, session affinity."""
