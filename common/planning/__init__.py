"""How fast a cluster could train and which method suits it: the cluster file, the optimum, the predictor."""
