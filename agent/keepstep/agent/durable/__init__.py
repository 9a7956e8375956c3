"""keepstep.agent.durable: durable checkpoints to any fsspec URL (`file://`, `s3://`).

storage  the layout under a URL, its records, and the fsspec calls (the one module
         that talks to object storage)
writer   one snapshot slot written every K steps, off the training path
parts    a sharded job's checkpoint: every member's snapshot, and the manifest
reader   the newest intact checkpoint, or the list of published ones
"""
