"""`stoker train`: the controller that conducts processes and signals, the run folder, several machines."""
