"""Consumer side: per-group, per-tier block index, event ingest, scorer and routing proxy.

Never imports ``engine_adapter`` or torch.
"""
