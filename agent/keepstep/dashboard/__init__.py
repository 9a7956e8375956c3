"""`keepstep dashboard`: a web page over run directories (and a cluster's TrainJobs).

reader.py reads run directories as they grow, data.py turns events into the page's
series (pure), trainjobs.py lists TrainJobs through the Kubernetes API, server.py serves
the page and its JSON on 127.0.0.1, cli.py adds the subcommand.
"""
