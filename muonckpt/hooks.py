"""placeholder"""
def attach_muon_hooks(optimizer):
    return None
