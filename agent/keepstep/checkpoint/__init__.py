"""keepstep.checkpoint: durable checkpoints opened without keepstep (`keepstep checkpoint`).

catalog   which steps a checkpoint location holds and the state of each (torch-free)
contents  one step's blob, verified and decoded into plain state dicts, and its hashes
export    those state dicts written as a `torch.save` file or a safetensors file
cli       `keepstep checkpoint ls URL` and `keepstep checkpoint export URL OUT`
"""
