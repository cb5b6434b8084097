"""What a scored prompt is, whoever scored it: the wire types every scorer returns (dialects:
a request, a prompt's scores; bounds: what is known of a distribution) and the scorer computed
here (inprocess). The engines' modules (fidelity.servers), kld, consistency and the engines'
replays all read and write these."""
