"""stoker outside `stoker train`: the Loader in a loop of one's own, a trained model loaded, eval and predict."""
